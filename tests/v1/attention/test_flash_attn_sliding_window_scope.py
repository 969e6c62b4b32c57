# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""FlashAttention's AOT sliding-window config comes from its own KV-cache group.

vllm-project/vllm#39516: ``_get_sliding_window_configs`` walked every
``Attention`` layer of the model. 0.20.2 already skips non-FlashAttention
layers, but still mixes groups: a model whose FlashAttention layers sit in
two groups with different windows (Gemma 4: sliding layers in one group,
boundary full layers in another once backends are routed per layer) turns
FA3's ahead-of-time scheduling off for both. Also: TurboQuant runs forced
FlashAttention 2 even when the user asked for FA3, so FA3 with TurboQuant
could not even be tried.
"""

import pytest

from tests.v1.attention.test_flash_attn_group_kv_cache_dtype import (
    attention_layer,
    import_flash_attn,
)
from vllm.config import VllmConfig

pytestmark = pytest.mark.cpu_test


@pytest.fixture
def flash_attn(monkeypatch):
    return import_flash_attn(monkeypatch)


def test_windows_are_gathered_from_the_builders_group(flash_attn):
    vllm_config = VllmConfig()
    context = vllm_config.compilation_config.static_forward_context
    fa = flash_attn.FlashAttentionImpl
    sliding = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2)]
    full = ["model.layers.5.self_attn.attn"]
    for name in sliding:
        context[name] = attention_layer(fa, (127, 0))
    for name in full:
        context[name] = attention_layer(fa, None)

    # The sliding group's builder sees one window and may schedule ahead of time.
    configs = flash_attn._get_sliding_window_configs(vllm_config, sliding)
    assert configs == {(127, 0)}
    assert flash_attn._get_sliding_window_configs(vllm_config, full) == {None}
    # Without a group, the whole model (upstream's behaviour).
    assert flash_attn._get_sliding_window_configs(vllm_config) == {(127, 0), None}


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(None, None), (2, 2), (3, 3)],
    ids=["default", "fa2", "fa3"],
)
def test_turboquant_leaves_the_flash_attn_version_alone(tmp_path, requested, expected):
    from tests.models.tiny_hybrids import builders
    from vllm.engine.arg_utils import EngineArgs

    path = builders.qwen3_dense(tmp_path / "qwen3")
    args = EngineArgs(
        model=str(path),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=1024,
        kv_cache_dtype="turboquant_4bit_nc",
        attention_config={"flash_attn_version": requested},
    )
    config = args.create_engine_config()
    # TurboQuant no longer forces FA2: with the windows scoped to each group FA3
    # runs beside TurboQuant layers (gemma4_matrix.py --fa3 on an H100), so the
    # platform's choice stands and an explicit one holds.
    assert config.attention_config.flash_attn_version == expected
