# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``--kv-cache-dtype-skip-layers sliding_window=DTYPE`` in a TurboQuant run:
sliding-window layers store FP8 or a per-token-head 8-bit dtype instead of the
model dtype (TurboQuant itself has no sliding-window kernel), at Gemma 4 31B's
real shapes.

Release 54 refuses the entry as not understood, so a Gemma 3/4 cache at 3-bit
TurboQuant still averaged over 4 bits per element (issue 46): its bf16 sliding
layers held a quarter of the bytes.
"""

import pytest
import torch

from tests.quantization.test_turboquant_layer_policy import attention, engine_config
from vllm.v1.kv_cache_interface import SlidingWindowSpec, TQFullAttentionSpec

pytestmark = pytest.mark.cpu_test

TQ = "turboquant_3bit_nc"
WINDOW = 1024


def gemma4(tmp_path, *skip, kv=TQ):
    return engine_config(
        tmp_path,
        "Gemma-4-31B",
        kv_cache_dtype=kv,
        tensor_parallel_size=4,
        kv_cache_dtype_skip_layers=list(skip),
    )


def sliding(config, index=2):
    return attention(
        config,
        f"model.layers.{index}.self_attn.attn",
        4,
        256,
        per_layer_sliding_window=WINDOW,
    )


def test_sliding_layers_store_fp8(tmp_path):
    config = gemma4(tmp_path, "sliding_window=fp8")
    skip = config.cache_config.kv_cache_dtype_skip_layers
    assert "sliding_window=fp8" in skip and "sliding_window" not in skip
    layer, spec = sliding(config)
    assert layer.kv_cache_dtype == "fp8"
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == WINDOW
    bf16_layer, bf16_spec = sliding(gemma4(tmp_path / "b"))
    assert bf16_layer.kv_cache_dtype == "auto" and bf16_spec.dtype == torch.bfloat16
    assert spec.page_size_bytes * 2 == bf16_spec.page_size_bytes
    # Full-attention layers keep the run's TurboQuant preset.
    full, full_spec = attention(config, "model.layers.5.self_attn.attn", 1, 512)
    assert full.kv_cache_dtype == TQ and isinstance(full_spec, TQFullAttentionSpec)


@pytest.mark.parametrize("dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_sliding_layers_store_a_per_token_head_dtype(tmp_path, dtype):
    """vLLM's per-token-head caches (a scale per token and head, read by
    Triton attention with the query unquantized) cost Gemma 3 a fifth of
    FP8's perplexity in an emulation; their pages carry the scales."""
    config = gemma4(tmp_path, f"sliding_window={dtype}")
    layer, spec = sliding(config)
    assert layer.kv_cache_dtype == dtype
    assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == WINDOW
    assert spec.kv_quant_mode.is_per_token_head
    _, fp8_spec = sliding(gemma4(tmp_path / "f", "sliding_window=fp8"))
    scales = 2 * spec.block_size * spec.num_kv_heads * 4
    assert spec.page_size_bytes == fp8_spec.page_size_bytes + scales


def test_a_layer_index_keeps_its_sliding_layer_at_the_model_dtype(tmp_path):
    config = gemma4(tmp_path, "sliding_window=fp8", "3")
    kept, spec = sliding(config, 3)
    other, _ = sliding(config, 2)
    assert (kept.kv_cache_dtype, other.kv_cache_dtype) == ("auto", "fp8")
    assert spec.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "skip, kv, message",
    [
        (
            ["sliding_window=fp16"],
            TQ,
            r"'sliding_window=fp16': sliding-window layers of a TurboQuant run can "
            r"store fp8, fp8_e4m3, int8_per_token_head or fp8_per_token_head",
        ),
        (
            ["sliding_window", "sliding_window=fp8"],
            TQ,
            r"'sliding_window' and 'sliding_window=fp8' give sliding-window layers "
            r"two KV dtypes",
        ),
        (
            ["sliding_window=fp8", "sliding_window=fp8_e4m3"],
            TQ,
            r"two KV dtypes \(sliding_window=fp8, sliding_window=fp8_e4m3\)",
        ),
    ],
)
def test_bad_entries_are_refused_with_the_rule(tmp_path, skip, kv, message):
    with pytest.raises(ValueError, match=message):
        gemma4(tmp_path, *skip, kv=kv)


def test_a_model_without_sliding_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"has no sliding-window layers, so the entry"):
        engine_config(
            tmp_path,
            "Qwen3-4B",
            kv_cache_dtype=TQ,
            kv_cache_dtype_skip_layers=["sliding_window=fp8"],
        )


def test_a_run_that_is_not_turboquant_is_refused(tmp_path):
    config = gemma4(tmp_path, "sliding_window=fp8", kv="auto")
    with pytest.raises(ValueError, match=r"but the KV cache dtype is 'auto'"):
        sliding(config)


def test_serve_help_names_the_entry(monkeypatch):
    from vllm.config import CacheConfig
    from vllm.engine import arg_utils

    # Help texts are read only when the command line asks for help.
    monkeypatch.setattr(arg_utils, "NEEDS_HELP", True)
    arg_utils._compute_kwargs.cache_clear()
    try:
        kwargs = arg_utils.get_kwargs(CacheConfig)
    finally:
        arg_utils._compute_kwargs.cache_clear()
    text = " ".join(kwargs["kv_cache_dtype_skip_layers"]["help"].split())
    assert "'sliding_window=DTYPE' stores them in an 8-bit dtype" in text, text
    assert "int8_per_token_head" in text, text
    assert "'recent:W'" in text, text
