# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A TurboQuant layer may store another preset than the run's:
``--kv-cache-dtype-skip-layers 19=turboquant_4bit_nc`` in a
``turboquant_3bit_nc`` run gives attention layer 19 4-bit keys and values,
every other quantized layer 3-bit ones.

Release 43 refuses the entry as not understood. The runner shaped every
TurboQuant layer's cache from the run's dtype, so a layer of another preset
would have read and written its neighbours' slot width; the store now refuses
a cache whose slots are not its layer's.
"""

import pytest
import torch

from tests.quantization.test_turboquant_layer_policy import attention, engine_config
from vllm.model_executor.layers.quantization.turboquant.config import (
    TurboQuantConfig,
)
from vllm.v1.kv_cache_interface import TQFullAttentionSpec

pytestmark = pytest.mark.cpu_test

RUN = "turboquant_3bit_nc"
OWN = "turboquant_4bit_nc"


def slot(preset, head_dim=128):
    return TurboQuantConfig.from_cache_dtype(preset, head_dim).slot_size_aligned


def test_a_layer_stores_its_own_preset(tmp_path):
    config = engine_config(
        tmp_path,
        "Qwen3-4B",
        kv_cache_dtype=RUN,
        kv_cache_dtype_skip_layers=[f"19={OWN}"],
    )
    # Boundary protection still keeps Qwen3-4B's first and last two layers.
    assert config.cache_config.kv_cache_dtype_skip_layers == [
        "0",
        "1",
        f"19={OWN}",
        "34",
        "35",
    ]
    own, own_spec = attention(config, "model.layers.19.self_attn.attn", 8, 128)
    run, run_spec = attention(config, "model.layers.18.self_attn.attn", 8, 128)
    kept, kept_spec = attention(config, "model.layers.0.self_attn.attn", 8, 128)
    mtp, _ = attention(config, "mtp.layers.0.self_attn.attn", 8, 128)
    assert (own.kv_cache_dtype, run.kv_cache_dtype) == (OWN, RUN)
    assert isinstance(own_spec, TQFullAttentionSpec)
    assert (own_spec.tq_slot_size, run_spec.tq_slot_size) == (slot(OWN), slot(RUN))
    assert own_spec.page_size_bytes > run_spec.page_size_bytes
    assert kept.kv_cache_dtype == "auto" and kept_spec.dtype == torch.bfloat16
    # A drafter's layers keep following the run's dtype, not a main layer's.
    assert mtp.kv_cache_dtype == RUN


def test_a_hybrid_takes_presets_on_its_attention_layers(tmp_path):
    config = engine_config(
        tmp_path,
        "Qwen3.6-27B",
        kv_cache_dtype=RUN,
        language_model_only=True,
        kv_cache_dtype_skip_layers=[f"63={OWN}", f"7={OWN}"],
    )
    assert config.cache_config.kv_cache_dtype_skip_layers == [f"7={OWN}", f"63={OWN}"]
    layer, spec = attention(config, "model.layers.63.self_attn.attn", 4, 256)
    assert layer.kv_cache_dtype == OWN and spec.tq_slot_size == slot(OWN, 256)


@pytest.mark.parametrize(
    "model, entries, kwargs, match",
    [
        ("Qwen3-4B", ["19=fp8"], {}, r"'19=fp8': expected 'N=PRESET'.*turboquant_"),
        ("Qwen3-4B", ["x=" + OWN], {}, r"'x=turboquant_4bit_nc': expected 'N=PRESET'"),
        (
            "Qwen3.6-27B",
            ["4=" + OWN],
            {"language_model_only": True},
            r"layer 4 has no KV cache .*attention layers are \[3, 7, ",
        ),
        ("Qwen3-4B", ["19", "19=" + OWN], {}, r"'19' and '19=.*two KV dtypes"),
        (
            "Qwen3-4B",
            ["19=" + OWN, "19=turboquant_k8v4"],
            {},
            r"layer 19 two presets",
        ),
        ("Qwen3-4B", ["1=" + OWN], {}, r"layer 1 is kept .*boundary:2.*boundary:0"),
        (
            "Gemma-4-31B",
            ["2=" + OWN],
            {"tensor_parallel_size": 4},
            r"layer 2 is a sliding-window layer.*full-attention layer",
        ),
    ],
)
def test_bad_preset_entries_are_named(tmp_path, model, entries, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine_config(
            tmp_path,
            model,
            kv_cache_dtype=RUN,
            kv_cache_dtype_skip_layers=entries,
            **kwargs,
        )


def test_a_preset_entry_needs_a_turboquant_run(tmp_path):
    config = engine_config(
        tmp_path,
        "Qwen3-4B",
        kv_cache_dtype="auto",
        kv_cache_dtype_skip_layers=[f"19={OWN}"],
    )
    with pytest.raises(ValueError, match=r"layers \[19\] .*'auto'.*turboquant_"):
        attention(config, "model.layers.19.self_attn.attn", 8, 128)
