# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GPU: tiny Qwen3.5-like and Qwen3-Next-like models boot and generate with
every TurboQuant preset, with and without an MTP layer (patches 0004/0005).

On pristine 0.20.2 every TurboQuant case stops at config time with
"TurboQuant KV cache is not supported for hybrid (attention + Mamba) models".
The whole matrix, in parallel and with KV-token counts, is
``python -m tests.models.tiny_hybrids.turboquant_matrix``.
"""

import pytest

from .turboquant_matrix import MODELS, PADDED, PRESETS, run_one


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [False, True], ids=["no-mtp", "mtp"])
@pytest.mark.parametrize("kv_cache_dtype", PRESETS)
@pytest.mark.parametrize("name", MODELS)
def test_tiny_hybrid_turboquant_generates(name, kv_cache_dtype, mtp, tmp_path):
    result = run_one(name, kv_cache_dtype, mtp, tmp_path)
    print(result)
    assert result["rc"] == 0, result["log_tail"]
    assert result["lengths"] == [24] * 4
    assert result["kv_tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config", PADDED, ids=["tq-boundary1", "tq-boundary1-mtp", "dense-draft", "tq-dense-draft"]
)
def test_tiny_hybrid_with_padded_pages_generates(config, tmp_path):
    name, kv_cache_dtype, mtp, extra = config
    result = run_one(name, kv_cache_dtype, mtp, tmp_path, extra)
    print(result)
    assert result["rc"] == 0, result["log_tail"]
    assert result["lengths"] == [24] * 4
    assert any("KV cache pages unified" in line for line in result["planner_lines"])
