# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The capacity planner (patch 0006) never plans the impossible (issue 43).

Each test names the case of the issue it reproduces; on release 27 each one
failed: an impossible geometry got a confident plan, an option was taken and
ignored, a figure disagreed with the engine's, or the Python API stopped on a
host without a GPU.
"""

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from tests.models.tiny_hybrids.shapes import write_full_size_config
from tests.v1.core.test_kv_cache_capacity import (
    CODER_NEXT_DRAFT,
    GIB,
    QWEN36,
    capacity,
    plan,
)

NAMES = (
    "Qwen3.6-27B",
    "Qwen3-Coder-Next-80B-A3B",
    "LocoOperator-4B",
    "Gemma-4-31B",
    "Qwen3-4B",
)
# The hybridkv series' engine modules that change planning (0001, 0004,
# 0005, 0009): present means a patched install.
SERIES_MODULES = (
    "vllm.v1.core.kv_cache_planning_errors",
    "vllm.v1.core.kv_cache_page_unify",
    "vllm.model_executor.layers.quantization.turboquant.layer_policy",
    "vllm.v1.core.kv_cache_draft_groups",
)


def _patched() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in SERIES_MODULES)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_size_inputs")
    return {n: str(write_full_size_config(n, root / n)) for n in NAMES}


def edited(model_dir: str, dst: Path, **changes) -> str:
    """A copy of ``model_dir``'s config.json with ``changes`` applied to its
    text config (``text_config`` where the model nests one)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config.get("text_config", config).update(changes)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


# --- impossible attention geometry ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "changes", "expected"),
    [
        (
            "Qwen3-4B",
            {"num_key_value_heads": 64},
            "num_key_value_heads=64 (KV heads) is more than num_attention_heads=32",
        ),
        (
            "Qwen3-4B",
            {"num_key_value_heads": 5},
            "num_attention_heads=32 (query heads) is not a multiple of "
            "num_key_value_heads=5",
        ),
        ("Qwen3-4B", {"num_key_value_heads": 0}, "num_key_value_heads=0 (KV heads)"),
        ("Qwen3-4B", {"num_key_value_heads": -8}, "num_key_value_heads=-8"),
        ("Qwen3-4B", {"num_attention_heads": 0}, "num_attention_heads=0"),
        ("Qwen3-4B", {"num_attention_heads": -32}, "num_attention_heads=-32"),
        ("Qwen3-4B", {"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ("Qwen3-4B", {"num_hidden_layers": -3}, "num_hidden_layers=-3"),
        ("Qwen3-4B", {"head_dim": 0}, "head_dim=0"),
        ("Qwen3-4B", {"head_dim": -128}, "head_dim=-128"),
        ("Qwen3-4B", {"num_key_value_heads": "8"}, "num_key_value_heads"),
        ("Qwen3-4B", {"num_hidden_layers": "36"}, "num_hidden_layers"),
        (
            "Qwen3-Coder-Next-80B-A3B",
            {"num_key_value_heads": 32},
            "num_key_value_heads=32 (KV heads) is more than num_attention_heads=16",
        ),
        (
            "Qwen3-Coder-Next-80B-A3B",
            {"num_attention_heads": 12, "num_key_value_heads": 8},
            "num_attention_heads=12 (query heads) is not a multiple of "
            "num_key_value_heads=8",
        ),
        ("Qwen3-Coder-Next-80B-A3B", {"head_dim": 0}, "head_dim=0"),
        ("Qwen3-Coder-Next-80B-A3B", {"linear_num_key_heads": 0}, "linear_num_key"),
        (
            "Qwen3.6-27B",
            {"num_key_value_heads": 48},
            "num_key_value_heads=48 (KV heads) is more than num_attention_heads=24",
        ),
        (
            "Gemma-4-31B",
            {"num_global_key_value_heads": 64},
            "num_global_key_value_heads=64 (full-attention KV heads) is more than "
            "num_attention_heads=32",
        ),
        ("Gemma-4-31B", {"global_head_dim": -512}, "global_head_dim=-512"),
    ],
)
def test_impossible_geometry_is_refused_by_name(
    models, tmp_path, name, changes, expected
):
    model = edited(models[name], tmp_path / "bad", **changes)
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(model, kv_cache_memory_bytes=8 * GIB, language_model_only=True)
    message = str(e.value)
    print(message)
    assert expected in message
    assert (e.value.field, e.value.value) == ("model", model)
    assert message.startswith(f"model={model!r}: ")
    assert "config.json" in message


def test_impossible_draft_geometry_is_refused_by_name(models, tmp_path):
    draft = edited(models["LocoOperator-4B"], tmp_path / "draft", head_dim=0)
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(
            models["Qwen3-Coder-Next-80B-A3B"],
            draft=draft,
            num_speculative_tokens=3,
            kv_cache_memory_bytes=8 * GIB,
        )
    assert str(e.value).startswith(f"draft={draft!r}: ")
    assert "head_dim=0" in str(e.value)


# --- the Python API on a host without a GPU -----------------------------------


def test_python_api_plans_on_a_host_without_a_gpu(models):
    """README: `plan_capacity(CapacityRequest(...))` works wherever the CLI does
    (release 27: RuntimeError: Device string must not be empty)."""
    code = (
        "from vllm.v1.core.kv_cache_capacity import CapacityRequest, plan_capacity\n"
        f"r = plan_capacity(CapacityRequest(model={models['Qwen3-4B']!r}, "
        f"max_model_len=4096, kv_cache_memory_bytes={GIB}))\n"
        "print('KV_TOKENS', r.kv_tokens, r.error)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDKV_TEST_PLATFORM"}
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 144 KiB per token.
    assert f"KV_TOKENS {GIB // (144 * 1024) // 16 * 16} None" in out.stdout


# --- the engine's max_num_batched_tokens --------------------------------------

GEMMA_80G = dict(
    max_model_len=131072,
    gpu_memory_gib=80,
    gpu_memory_utilization=0.9,
    weights_gib=58.3,
)


def test_gemma_4_on_80_gib_takes_vllm_serves_default_batch(models):
    """`vllm serve` on a GPU of >= 70 GiB schedules 8192 tokens a step; the
    sliding-window layers then hold 1023 + 8192 tokens per request and the
    engine refuses 131,072 tokens in 12.70 GiB (release 27 planned 134,697
    tokens with 2048)."""
    report = plan(models["Gemma-4-31B"], **GEMMA_80G)
    assert report.max_num_batched_tokens == 8192
    assert report.error is not None
    assert "(17.04 GiB KV cache is needed, which is larger than" in report.error


@pytest.mark.parametrize(
    ("kw", "tokens"),
    [
        ({}, 8192),  # vllm serve, >= 70 GiB
        ({"usage_context": "llm"}, 16384),  # the LLM class, >= 70 GiB
        ({"gpu_memory_gib": 48, "weights_gib": 20}, 2048),  # serve, < 70 GiB
        ({"gpu_memory_gib": 48, "weights_gib": 20, "usage_context": "llm"}, 8192),
        # vLLM keeps A100s (SM 8.0) at the small defaults whatever their memory.
        ({"device_capability": "8.0"}, 2048),
        ({"max_num_batched_tokens": 4096}, 4096),
    ],
)
def test_max_num_batched_tokens_is_the_engines(models, kw, tokens):
    report = plan(models["Qwen3-4B"], **{**GEMMA_80G, "max_model_len": 8192, **kw})
    assert report.error is None, report.error
    assert report.max_num_batched_tokens == tokens


def test_gemma_4_plans_with_a_smaller_batch(models):
    report = plan(models["Gemma-4-31B"], max_num_batched_tokens=2048, **GEMMA_80G)
    assert report.error is None, report.error
    assert report.kv_tokens == 134697


# --- --pristine on a patched install --------------------------------------------


def test_pristine_reproduces_0_20_2_or_refuses(models):
    request = dict(kv_cache_dtype="turboquant_4bit_nc", pristine=True, **QWEN36)
    if not _patched():
        # An unpatched vLLM 0.20.2: its own refusal.
        report = plan(models["Qwen3.6-27B"], **request)
        assert "TurboQuant KV cache is not supported for hybrid" in report.error
        return
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models["Qwen3.6-27B"], **request)
    message = str(e.value)
    assert message.startswith("pristine=True: ")
    assert "vllm.v1.core.kv_cache_page_unify" in message
    assert "0.20.2" in message


# --- padding: the engine's model ------------------------------------------------


def test_padding_counts_the_engines_padding_layers(models, caplog_vllm):
    """A dense draft beside Qwen3-Coder-Next pads the main model's 12
    full-attention layers to the drafter's group size: the engine warns
    "Add N padding layers, may waste at most X%"; the planner's figure
    counts those empty page slots (release 27 printed 0.00 %)."""
    caplog_vllm.set_level(logging.DEBUG, logger="vllm")
    report = plan(
        models["Qwen3-Coder-Next-80B-A3B"],
        draft=models["LocoOperator-4B"],
        **CODER_NEXT_DRAFT,
    )
    assert report.error is None, report.error
    warned = [
        re.search(r"Add (\d+) padding layers, may waste at most ([\d.]+)%", m)
        for m in caplog_vllm.messages
    ]
    warned = [m for m in warned if m]
    assert report.padding_layers == sum(int(m[1]) for m in warned)
    for m in warned:
        assert any(f"may waste at most {m[2]}%" in w for w in report.padding_warnings)
    text = capacity.format_report(report)
    if warned:
        assert report.padding_layers > 0
        # Empty slots weigh as much as the blocks their group holds: at
        # least the share of the full-attention requests' memory they take.
        assert report.padding_fraction > 0.05
        assert f"{report.padding_layers} padding layers" in text
    assert f"{100 * report.padding_fraction:.2f}%" in text


def test_padding_without_empty_slots_is_the_engines_page_padding(models, caplog_vllm):
    """Where no layer slot is empty, the figure is the engine's page padding:
    the "wastes X% of KV cache memory" of its page unification."""
    caplog_vllm.set_level(logging.DEBUG, logger="vllm")
    report = plan(models["Qwen3.6-27B"], kv_cache_dtype="turboquant_4bit_nc", **QWEN36)
    assert report.error is None, report.error
    assert report.padding_layers == 0
    pages = [p for g in report.groups for p in g["layer_pages"]]
    padding = sum(p["layers"] * p["padding_bytes"] for p in pages)
    whole = sum(p["layers"] * p["page_size_bytes"] for p in pages)
    assert report.padding_fraction == pytest.approx(padding / whole)
    logged = [
        re.search(r"wastes ([\d.]+)% of KV cache memory", m)
        for m in caplog_vllm.messages
    ]
    for m in filter(None, logged):
        assert f"{100 * report.padding_fraction:.2f}" == m[1]


# --- the per-page column ----------------------------------------------------------


def test_page_bytes_are_per_layer_for_every_spec_type(models):
    """Qwen3-4B with TurboQuant is one UniformTypeKVCacheSpecs group whose
    page_size_bytes is the sum over its 36 layers; release 27 printed that sum
    where other groups print one layer's page."""
    report = plan(
        models["Qwen3-4B"],
        kv_cache_dtype="turboquant_4bit_nc",
        max_model_len=32768,
        kv_cache_memory_bytes=4 * GIB,
    )
    assert report.error is None, report.error
    (group,) = report.groups
    assert group["type"] == "UniformTypeKVCacheSpecs"
    rows = {p["dtype"]: p for p in group["layer_pages"]}
    # A bf16 layer: 16 tokens x 8 KV heads x 128 x 2 (K, V) x 2 bytes.
    assert rows["torch.bfloat16"]["page_size_bytes"] == 16 * 8 * 128 * 2 * 2
    assert rows["torch.bfloat16"]["layers"] == 4
    assert sum(p["layers"] for p in group["layer_pages"]) == 36
    assert group["page_size_bytes"] is None  # layers of two page sizes
    text = capacity.format_report(report)
    assert "page B/layer" in text
    assert f"{16 * 8 * 128 * 2 * 2:,}" in text
    # Hybrid groups: one page per layer, the same for every group.
    hybrid = plan(
        models["Qwen3.6-27B"],
        max_model_len=32768,
        kv_cache_memory_bytes=8 * GIB,
        language_model_only=True,
    )
    assert hybrid.error is None, hybrid.error
    pages = {p["page_size_bytes"] for g in hybrid.groups for p in g["layer_pages"]}
    assert pages == {hybrid.page_size_bytes}


# --- options accepted with no effect ------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kw", "expected"),
    [
        (
            "Qwen3.6-27B",
            {"kv_cache_dtype_skip_layers": ["0"]},
            "kv_cache_dtype_skip_layers='0': layer 0 is a linear-attention",
        ),
        (
            "Qwen3.6-27B",
            {"kv_cache_dtype_skip_layers": ["3", "62"]},
            "kv_cache_dtype_skip_layers='62': layer 62 is a linear-attention",
        ),
        (
            "Qwen3.6-27B",
            {"kv_cache_dtype_skip_layers": ["boundary:17"]},
            "'boundary:17': the model has 16 attention layers",
        ),
        (
            "Qwen3.6-27B",
            {"kv_cache_dtype_skip_layers": ["boundary:8"]},
            "kv_cache_dtype='turboquant_4bit_nc': no attention layer is left",
        ),
        (
            "Qwen3-4B",
            {"kv_cache_dtype_skip_layers": ["sliding_window"]},
            "'sliding_window': the model has no sliding-window layers",
        ),
        (
            "Qwen3-4B",
            {"kv_cache_dtype_skip_layers": ["draft"]},
            "'draft': there is no drafter",
        ),
        (
            "Qwen3-4B",
            {"kv_cache_dtype": "auto", "kv_cache_dtype_skip_layers": ["3"]},
            "the KV cache is not quantized",
        ),
        (
            "Qwen3-4B",
            {"kv_cache_dtype": "fp8", "kv_cache_dtype_skip_layers": ["boundary:1"]},
            "'boundary:1': boundary protection is TurboQuant's",
        ),
        ("Qwen3-4B", {"device_capability": "99.9"}, "device_capability='99.9': "),
        ("Qwen3-4B", {"device_capability": "13.0"}, "device_capability='13.0': "),
        (
            "Qwen3-4B",
            {"mamba_ssm_cache_dtype": "float32"},
            "mamba_ssm_cache_dtype='float32': the model has no GDN/Mamba layers",
        ),
    ],
)
def test_options_without_effect_are_refused(models, name, kw, expected):
    import torch

    if "device_capability" in kw and not torch._C._cuda_getArchFlags():
        pytest.skip("this torch has no CUDA architectures to check against")
    request = {"kv_cache_dtype": "turboquant_4bit_nc", **QWEN36, **kw}
    if name == "Qwen3-4B":
        # Its native context is 40,960 tokens.
        request.update(language_model_only=False, max_model_len=32768)
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(models[name], **request)
    print(e.value)
    assert expected in str(e.value)
    assert "--" not in str(e.value)
    assert e.value.field in {f.name for f in fields(capacity.CapacityRequest)}


def test_options_replaced_by_kv_cache_memory_bytes_warn(models):
    report = plan(
        models["Qwen3-4B"],
        kv_cache_memory_bytes=4 * GIB,
        weights_gib=8,
        overhead_gib=2,
    )
    assert report.error is None
    # Request fields in backquotes, as the command line maps them to options.
    first = report.warnings[0]
    assert first.startswith("`weights_gib` 8: no effect, `kv_cache_memory_bytes` ")
    assert any(w.startswith("`overhead_gib` 2: ") for w in report.warnings)
    assert "`weights_gib` 8" in capacity.format_report(report)
    assert not any("--" in w for w in report.warnings)


# --- Mamba/GDN cache dtypes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "conv", "ssm"),
    [
        ({}, "bfloat16", "bfloat16"),
        ({"mamba_ssm_cache_dtype": "float32"}, "bfloat16", "float32"),
        ({"mamba_cache_dtype": "float32"}, "float32", "float32"),
        (
            {"mamba_cache_dtype": "float16", "mamba_ssm_cache_dtype": "float32"},
            "float16",
            "float32",
        ),
    ],
)
def test_mamba_cache_dtypes_are_the_engines(models, kw, conv, ssm):
    import torch

    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
    )

    report = plan(
        models["Qwen3-Coder-Next-80B-A3B"],
        max_model_len=65536,
        kv_cache_memory_bytes=8 * GIB,
        **kw,
    )
    assert report.error is None, report.error
    mamba = next(g for g in report.groups if g["type"] == "MambaSpec")
    # The dtypes the engine's GDN layer asks for (get_state_dtype).
    expected = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        torch.bfloat16,
        kw.get("mamba_cache_dtype", "auto"),
        kw.get("mamba_ssm_cache_dtype", "auto"),
    )
    assert mamba["dtype"] == str(tuple(expected))
    assert str(expected) == str((getattr(torch, conv), getattr(torch, ssm)))
    if kw:
        base = plan(
            models["Qwen3-Coder-Next-80B-A3B"],
            max_model_len=65536,
            kv_cache_memory_bytes=8 * GIB,
        )
        # A float32 state is a larger Mamba page: fewer tokens in 8 GiB.
        assert report.kv_tokens < base.kv_tokens


def test_mamba_cache_dtype_outside_vllms_choices_is_named(models):
    with pytest.raises(capacity.CapacityInputError) as e:
        plan(
            models["Qwen3-Coder-Next-80B-A3B"],
            kv_cache_memory_bytes=8 * GIB,
            mamba_ssm_cache_dtype="float64",
        )
    assert "mamba_ssm_cache_dtype='float64': " in str(e.value)
    assert "'auto', 'float32', 'float16'" in str(e.value)
