# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The models of the bug reports, at their real shapes, through the engine's
planning (config checks, per-layer specs, hybrid page planner, unification,
block counts) via the capacity planner (patch 0006).

On pristine 0.20.2 each fails the way its report says: Qwen3.6-27B with
TurboQuant is refused for being hybrid (#41560's build removed that refusal
and then hit the unification assert), Qwen3-Coder-Next + LocoOperator-4B dies
on the bare assert (#43626), Gemma-4-31B at TP=4 on "not divisible"
(#41403 Gate 5). Qwen3-4B (dense) is the control: it plans the same on both.
The planner module is loaded from this repository when the installed vLLM
has none, and then applies 0.20.2's own rules.
"""

import importlib
import importlib.util
import json
from dataclasses import fields
from pathlib import Path

import pytest

from tests.models.tiny_hybrids.shapes import write_full_size_config

REPO = Path(__file__).resolve().parents[3]
TQ_PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
GIB = 2**30
# Padding, as a share of KV-cache memory, the planner must stay under.
MAX_PADDING = 0.01


def _capacity_module():
    try:
        return importlib.import_module("vllm.v1.core.kv_cache_capacity")
    except ImportError:
        path = REPO / "vllm/v1/core/kv_cache_capacity.py"
        spec = importlib.util.spec_from_file_location("kv_cache_capacity", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


capacity = _capacity_module()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size")
    names = [
        "Qwen3.6-27B",
        "Qwen3-Coder-Next-80B-A3B",
        "LocoOperator-4B",
        "Gemma-4-31B",
        "Qwen3-4B",
    ]
    return {n: str(write_full_size_config(n, root / n)) for n in names}


def plan(model: str, **kw):
    kw.setdefault("max_model_len", 4096)
    if "kv_cache_dtype_skip_layers" in kw:
        kw["kv_cache_dtype_skip_layers"] = tuple(kw["kv_cache_dtype_skip_layers"])
    report = capacity.plan_capacity(capacity.CapacityRequest(model=model, **kw))
    print(capacity.format_report(report))
    return report


def _padding_ok(report, limit: float = MAX_PADDING):
    """Page padding under ``limit``; empty layer slots (a drafter's group
    size, patch 0009; an MTP layer) come on top, as the engine counts them."""
    assert report.error is None, report.error
    slots = len(report.groups) * max(g["layers"] for g in report.groups)
    page_padding = report.padding_fraction - report.padding_layers / slots
    assert page_padding <= limit, report.padding_fraction


# Qwen3-Coder-Next with a LocoOperator-4B-shaped dense draft (k=3); the
# main model's and the draft's paths come from ``models``.
CODER_NEXT_DRAFT = dict(
    kv_cache_dtype="fp8_e4m3",
    num_speculative_tokens=3,
    max_model_len=65536,
    kv_cache_memory_bytes=8 * GIB,
)

# Qwen3.6-27B int4 on a 24 GB card (report #41560's command line).
QWEN36 = dict(
    max_model_len=96000,
    gpu_memory_gib=24,
    gpu_memory_utilization=0.97,
    weights_gib=16.6,
    language_model_only=True,
)


@pytest.mark.parametrize("preset", TQ_PRESETS)
def test_qwen3_6_27b_turboquant_plans_without_waste(models, preset):
    report = plan(models["Qwen3.6-27B"], kv_cache_dtype=preset, **QWEN36)
    _padding_ok(report)
    # All 16 full-attention layers are quantized; GDN layers keep their state.
    assert report.layer_dtypes == {preset: 16}
    baseline = plan(
        models["Qwen3.6-27B"],
        kv_cache_dtype="auto",
        **{**QWEN36, "max_model_len": 32768},
    )
    assert report.kv_tokens > baseline.kv_tokens


def test_qwen3_6_27b_boundary_layers_and_mtp(models):
    """Non-default policy: 1 boundary attention layer each side, MTP drafting."""
    report = plan(
        models["Qwen3.6-27B"],
        kv_cache_dtype="turboquant_4bit_nc",
        kv_cache_dtype_skip_layers=["boundary:1"],
        num_speculative_tokens=3,
        **QWEN36,
    )
    assert report.error is None, report.error
    # Layers 3 and 63 at bf16; 14 main layers and the MTP layer quantized.
    assert report.layer_dtypes == {"auto": 2, "turboquant_4bit_nc": 15}
    _padding_ok(report, 0.03)


def test_qwen3_coder_next_with_locooperator_draft(models):
    report = plan(
        models["Qwen3-Coder-Next-80B-A3B"],
        draft=models["LocoOperator-4B"],
        **CODER_NEXT_DRAFT,
    )
    _padding_ok(report)
    assert sum(report.layer_dtypes.values()) == 12 + 36


def test_gemma_4_31b_tp4_turboquant_native_context(models):
    report = plan(
        models["Gemma-4-31B"],
        kv_cache_dtype="turboquant_4bit_nc",
        tensor_parallel_size=4,
        max_model_len=262144,
        gpu_memory_gib=16,
        gpu_memory_utilization=0.92,
        weights_gib=31,
    )
    _padding_ok(report)
    # Sliding-window layers stay bf16 (no TurboQuant sliding kernel); full
    # layers other than the last (boundary) are quantized.
    assert report.layer_dtypes == {"auto": 51, "turboquant_4bit_nc": 9}
    assert report.max_concurrency >= 1


def test_qwen3_4b_dense_control(models):
    report = plan(
        models["Qwen3-4B"],
        kv_cache_dtype="turboquant_4bit_nc",
        max_model_len=32768,
        kv_cache_memory_bytes=4 * GIB,
    )
    assert report.error is None, report.error
    assert report.padding_fraction == 0
    assert report.layer_dtypes == {"auto": 4, "turboquant_4bit_nc": 32}


def test_attention_backend_per_layer_kind_on_cuda(models):
    """Each layer kind gets what CUDA's selection picks on the target GPU."""
    report = plan(
        models["Qwen3.6-27B"],
        kv_cache_dtype="turboquant_4bit_nc",
        kv_cache_dtype_skip_layers=["boundary:1"],
        **QWEN36,
    )
    assert report.error is None, report.error
    assert report.device_capability == "9.0"
    assert report.attention_backends == {
        "full attention, head_size 256, KV auto": "FLASH_ATTN",
        "full attention, head_size 256, KV turboquant_4bit_nc": "TURBOQUANT",
    }
    assert not report.backend_errors
    text = capacity.format_report(report)
    assert "attention backends on CUDA SM 9.0:" in text


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {"tensor_parallel_size": 0},
            "tensor_parallel_size=0: must be greater than 0",
        ),
        (
            {"gpu_memory_utilization": 1.5},
            "gpu_memory_utilization=1.5: must be in (0, 1]",
        ),
        (
            {"gpu_memory_utilization": 0.0},
            "gpu_memory_utilization=0.0: must be in (0, 1]",
        ),
        ({"weights_gib": -50}, "weights_gib=-50: must be greater than 0"),
        ({"gpu_memory_gib": 0}, "gpu_memory_gib=0: must be greater than 0"),
        ({"overhead_gib": -1}, "overhead_gib=-1: must be 0 or more"),
        ({"weights_gib": 100}, "nothing left for the KV cache"),
        ({"max_model_len": 0}, "max_model_len=0: must be greater than 0"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens=-1"),
        ({"device_capability": "ninety"}, "device_capability='ninety': expected"),
        (
            {"kv_cache_memory_bytes": 0},
            "kv_cache_memory_bytes=0: must be greater than 0",
        ),
        ({"gpu_memory_gib": None}, "no memory to plan with"),
    ],
)
def test_bad_inputs_are_named(models, kw, expected):
    request = {**QWEN36, **kw}
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models["Qwen3.6-27B"], **request)
    assert expected in str(e.value)
    # The Python API names request fields, never a command-line option.
    assert "--" not in str(e.value)
    if e.value.field is not None:
        assert e.value.field in {f.name for f in fields(capacity.CapacityRequest)}
        assert str(e.value).startswith(f"{e.value.field}={e.value.value!r}: ")


def test_python_api_error_names_the_field_not_the_option(models):
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models["Qwen3-4B"], max_model_len=0, kv_cache_memory_bytes=GIB)
    assert (e.value.field, e.value.value) == ("max_model_len", 0)
    assert e.value.body == "must be greater than 0. Give the context length to plan."
    assert str(e.value) == f"max_model_len=0: {e.value.body}"
    assert "--max-model-len" not in str(e.value)
    # Other fields the fix names are in backquotes, as request fields.
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models["Qwen3-4B"], max_model_len=4096)
    assert e.value.field is None
    assert "give `kv_cache_memory_bytes` (the KV-cache memory per GPU)" in str(e.value)
    assert "--" not in str(e.value)


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(capacity.CapacityInputError, match="no such directory") as e:
        plan(str(tmp_path / "nope"), kv_cache_memory_bytes=GIB)
    assert (e.value.field, e.value.value) == ("model", str(tmp_path / "nope"))
    with pytest.raises(capacity.CapacityInputError, match="has no config.json") as e:
        plan(str(tmp_path), kv_cache_memory_bytes=GIB)
    assert str(e.value).startswith(f"model={str(tmp_path)!r}: ")


def test_tensor_parallel_must_shard_kv_heads(tmp_path, models):
    """12 query heads shard over 3 GPUs, 4 KV heads neither shard nor replicate."""
    config = json.loads((Path(models["Qwen3-4B"]) / "config.json").read_text())
    config.update(num_attention_heads=12, num_key_value_heads=4, hidden_size=1536)
    config.update(intermediate_size=4608, num_hidden_layers=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(str(tmp_path), tensor_parallel_size=3, kv_cache_memory_bytes=GIB)
    assert (e.value.field, e.value.value) == ("tensor_parallel_size", 3)
    assert "num_key_value_heads=4" in str(e.value)
    assert "Sizes that shard evenly: 1, 2, 4" in str(e.value)
    assert plan(
        str(tmp_path), tensor_parallel_size=2, kv_cache_memory_bytes=GIB
    ).kv_tokens


def test_tensor_parallel_must_shard_gdn_dims(models):
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models["Qwen3.6-27B"], tensor_parallel_size=3, kv_cache_memory_bytes=GIB)
    assert "linear_num_key_heads=16" in str(e.value)


def test_skip_layer_index_past_the_last_layer(models):
    with pytest.raises(capacity.CapacityInputError, match="has 64 layers") as e:
        plan(
            models["Qwen3.6-27B"],
            kv_cache_dtype="turboquant_4bit_nc",
            kv_cache_dtype_skip_layers=["99"],
            **QWEN36,
        )
    assert (e.value.field, e.value.value) == ("kv_cache_dtype_skip_layers", "99")


def test_engine_refusal_keeps_the_whole_cause(models):
    """Text mode shows every line of the engine's error, not just the first."""
    report = plan(models["Qwen3-4B"], max_model_len=10**9, kv_cache_memory_bytes=GIB)
    assert report.error.startswith("engine configuration: ValidationError")
    text = capacity.format_report(report)
    assert "max_model_len (1000000000) is greater than the derived" in text


@pytest.mark.parametrize("capability", ["9.0", "12.0"])
def test_gemma_4_backend_per_layer_kind(models, capability):
    """Every attention layer kind of Gemma-4-31B is either routed to a backend
    or reported with the engine's reason (0.20.2: the model config forces
    TRITON_ATTN, which rejects TurboQuant layers), for the GPU asked for."""
    report = plan(
        models["Gemma-4-31B"],
        kv_cache_dtype="turboquant_4bit_nc",
        tensor_parallel_size=4,
        max_model_len=262144,
        kv_cache_memory_bytes=8 * GIB,
        device_capability=capability,
    )
    assert report.error is None, report.error
    assert report.device_capability == capability
    kinds = {
        "sliding attention, head_size 256, KV auto",
        "full attention, head_size 512, KV auto",
        "full attention, head_size 512, KV turboquant_4bit_nc",
    }
    assert set(report.attention_backends) | set(report.backend_errors) == kinds
    assert report.fails == bool(report.backend_errors)
    for reason in report.backend_errors.values():
        assert "not valid" in reason or "No valid attention backend" in reason


@pytest.mark.parametrize(
    "model, kw, entries, dtypes, padding",
    [
        (
            "Qwen3-4B",
            dict(max_model_len=32768, kv_cache_memory_bytes=4 * GIB),
            ["boundary:0", "19=turboquant_4bit_nc", "7=turboquant_4bit_nc"],
            {"turboquant_3bit_nc": 34, "turboquant_4bit_nc": 2},
            0.0,
        ),
        (
            "Qwen3.6-27B",
            {**QWEN36, "language_model_only": True},
            ["7=turboquant_4bit_nc", "63=turboquant_4bit_nc"],
            {"turboquant_3bit_nc": 14, "turboquant_4bit_nc": 2},
            0.0575,
        ),
    ],
)
def test_layers_with_their_own_preset_are_planned(
    models, model, kw, entries, dtypes, padding
):
    """``N=PRESET`` entries: those layers' pages are their preset's, so the
    plan's KV tokens fall between the two presets' own plans. A hybrid's
    attention layers share one block size, the one that fits the larger
    per-token bytes to the GDN page (1,568 tokens here, 2,064 for 3-bit
    alone): the 3-bit layers' pages are then padded to the common page, as
    the plan says."""
    mixed = plan(
        models[model],
        kv_cache_dtype="turboquant_3bit_nc",
        kv_cache_dtype_skip_layers=entries,
        **kw,
    )
    assert mixed.error is None, mixed.error
    assert mixed.layer_dtypes == dtypes
    whole = [e for e in entries if "=" not in e]
    three, four = (
        plan(models[model], kv_cache_dtype=p, kv_cache_dtype_skip_layers=whole, **kw)
        for p in ("turboquant_3bit_nc", "turboquant_4bit_nc")
    )
    assert four.kv_tokens < mixed.kv_tokens < three.kv_tokens
    assert mixed.padding_fraction == pytest.approx(padding, abs=5e-4)
