# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which attention layers TurboQuant quantizes (patch 0005), at the real
shapes of the models in the bug reports, through ``create_engine_config`` and
real ``Attention`` layers (a stand-in backend, so no GPU is needed).

Pristine 0.20.2 refuses every hybrid, skips by decoder-layer index (three of
Qwen3.6-27B's four "boundary" layers are GDN layers), lets ``mtp.layers.0``
alias layer 0, and sizes a TurboQuant sliding-window layer as uint8.
"""

import pytest
import torch

from tests.models.tiny_hybrids.shapes import write_full_size_config
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.kv_cache_interface import SlidingWindowSpec, TQFullAttentionSpec

TQ = "turboquant_4bit_nc"


class _Impl:
    supports_quant_query_input = False

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return None


class _StandInBackend(CPUAttentionBackend):
    """Builds layers without kernels: the test is about per-layer KV dtypes."""

    @staticmethod
    def get_impl_cls():
        return _Impl


def engine_config(tmp_path, name, **kwargs):
    model = write_full_size_config(name, tmp_path / name)
    kwargs.setdefault("max_model_len", 4096)
    args = EngineArgs(
        model=str(model), skip_tokenizer_init=True, load_format="dummy", **kwargs
    )
    return args.create_engine_config()


def attention(vllm_config, prefix, num_kv_heads, head_size, **kwargs):
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            num_heads=num_kv_heads * 4,
            head_size=head_size,
            scale=1.0,
            num_kv_heads=num_kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=prefix,
            attn_backend=_StandInBackend,
            **kwargs,
        )
    return layer, layer.get_kv_cache_spec(vllm_config)


@pytest.mark.parametrize(
    "preset", ["turboquant_k8v4", TQ, "turboquant_k3v4_nc", "turboquant_3bit_nc"]
)
def test_qwen3_6_27b_accepts_turboquant(tmp_path, preset):
    """#41560: pristine refuses hybrids with NotImplementedError."""
    config = engine_config(
        tmp_path, "Qwen3.6-27B", kv_cache_dtype=preset, language_model_only=True
    )
    # Default for GDN hybrids: no boundary layers, every attention layer quantized.
    assert config.cache_config.kv_cache_dtype_skip_layers == []


def test_boundary_counts_attention_layers(tmp_path):
    config = engine_config(
        tmp_path,
        "Qwen3.6-27B",
        kv_cache_dtype=TQ,
        language_model_only=True,
        kv_cache_dtype_skip_layers=["boundary:2"],
    )
    # Attention layers are 3, 7, ..., 63: the first two and last two of them.
    assert config.cache_config.kv_cache_dtype_skip_layers == [
        "3",
        "7",
        "59",
        "63",
        "boundary:2",
    ]


def test_dense_default_is_unchanged(tmp_path):
    config = engine_config(tmp_path, "Qwen3-4B", kv_cache_dtype=TQ)
    assert config.cache_config.kv_cache_dtype_skip_layers == ["0", "1", "34", "35"]


def test_mtp_layer_does_not_alias_layer_0(tmp_path):
    """Layer 0 is a boundary layer of Qwen3-4B; ``mtp.layers.0`` is not layer 0."""
    config = engine_config(tmp_path, "Qwen3-4B", kv_cache_dtype=TQ)
    main, main_spec = attention(config, "model.layers.0.self_attn.attn", 8, 128)
    mtp, mtp_spec = attention(config, "mtp.layers.0.self_attn.attn", 8, 128)
    draft, _ = attention(config, "draft_model.model.layers.1.self_attn.attn", 8, 128)
    assert main.kv_cache_dtype == "auto" and main_spec.dtype == torch.bfloat16
    assert mtp.kv_cache_dtype == TQ and isinstance(mtp_spec, TQFullAttentionSpec)
    assert draft.kv_cache_dtype == TQ


def test_draft_layers_can_be_kept_at_model_dtype(tmp_path):
    config = engine_config(
        tmp_path, "Qwen3-4B", kv_cache_dtype=TQ, kv_cache_dtype_skip_layers=["draft"]
    )
    mtp, _ = attention(config, "mtp.layers.0.self_attn.attn", 8, 128)
    main, _ = attention(config, "model.layers.5.self_attn.attn", 8, 128)
    assert (mtp.kv_cache_dtype, main.kv_cache_dtype) == ("auto", TQ)


def test_gemma4_sliding_layers_keep_model_dtype(tmp_path):
    """Pristine: a TurboQuant sliding layer became SlidingWindowSpec(uint8),
    sized as an unpacked cache, on a backend with no window support."""
    config = engine_config(
        tmp_path, "Gemma-4-31B", kv_cache_dtype=TQ, tensor_parallel_size=4
    )
    assert "sliding_window" in config.cache_config.kv_cache_dtype_skip_layers
    layer, spec = attention(
        config, "model.layers.2.self_attn.attn", 4, 256, per_layer_sliding_window=1024
    )
    assert isinstance(spec, SlidingWindowSpec) and spec.dtype == torch.bfloat16
    full, full_spec = attention(config, "model.layers.5.self_attn.attn", 1, 512)
    assert isinstance(full_spec, TQFullAttentionSpec) and full_spec.tq_slot_size == 518


def test_bad_skip_entries_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"'boundary:x'.*boundary:N"):
        engine_config(
            tmp_path,
            "Qwen3-4B",
            kv_cache_dtype=TQ,
            kv_cache_dtype_skip_layers=["boundary:x"],
        )
    with pytest.raises(ValueError, match=r"'first2' is not understood"):
        engine_config(
            tmp_path,
            "Qwen3-4B",
            kv_cache_dtype=TQ,
            kv_cache_dtype_skip_layers=["first2"],
        )
    # An index past the last layer used to be ignored without a word.
    with pytest.raises(ValueError, match=r"entry 36: .* has 36 layers"):
        engine_config(
            tmp_path,
            "Qwen3-4B",
            kv_cache_dtype=TQ,
            kv_cache_dtype_skip_layers=["36"],
        )


def test_dtype_map_is_logged_once(tmp_path, caplog_vllm, monkeypatch):
    from vllm.model_executor.layers.quantization.turboquant import layer_policy

    # A fresh process's policy state: no decisions recorded, nothing logged.
    monkeypatch.setattr(layer_policy, "_DECISIONS", {})
    monkeypatch.setattr(layer_policy, "_LOGGED", False)
    config = engine_config(tmp_path, "Qwen3-4B", kv_cache_dtype=TQ)
    for i in (0, 5):
        attention(config, f"model.layers.{i}.self_attn.attn", 8, 128)
    layer_policy.log_kv_cache_dtype_map(config)
    layer_policy.log_kv_cache_dtype_map(config)
    text = caplog_vllm.text
    assert text.count("KV cache dtype per attention layer") == 1
    assert "model.layers.5" in text and "layer 0 in skip list" in text


def test_serve_help_names_every_kind_of_skip_entry(monkeypatch):
    """``vllm serve --help=all`` documents ``--kv-cache-dtype-skip-layers``
    from CacheConfig's field docstring; 0.20.2's named only layer indices and
    attention types, not ``boundary:N``, ``draft`` or the defaults."""
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
    for entry in ("'sliding_window'", "'draft'", "'boundary:N'"):
        assert entry in text, text
    assert "default 2 when every layer is attention, 0 on GDN/Mamba hybrids" in text
