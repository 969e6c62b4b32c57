# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""config.json writers for tiny random-weight versions of the models hybridkv targets.

Each builder writes a HF-style ``config.json`` into ``path`` and returns ``path``.
The tiny models keep what decides KV-cache layout and attention backends in the
real ones (layer pattern, head_dim, query:KV and GDN key:value head ratios,
MTP layers) and shrink everything else (width, depth, vocab, experts), so
a bf16 random-weight model is tens of MB and ``load_format="dummy"`` is fast.

All builders share ``TINY_VOCAB_SIZE`` and the special-token ids of
``tokenizer.py``, so any tiny model can serve as another's draft.

TurboQuant's default boundary protection keeps the first 2 and last 2 layers
(by global layer index) at the baseline dtype; every default below leaves at
least one attention layer outside that range so TurboQuant has work to do.

Keyword ``overrides`` (top level) and ``text_overrides`` (nested text config)
are merged last, for fields a test needs that have no named argument.
"""

import json
from pathlib import Path
from typing import Any

from .tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    write_tokenizer,
)

TINY_HIDDEN_SIZE = 256


def interval_layer_types(
    num_layers: int, interval: int, every: str, other: str
) -> list[str]:
    """Layer ``i`` is ``every`` when ``(i + 1) % interval == 0``, else ``other``.

    This is the rule the Qwen3.5/Qwen3-Next configs (full_attention_interval)
    and Gemma 4 (5 sliding : 1 full) use when ``layer_types`` is absent.
    """
    return [every if (i + 1) % interval == 0 else other for i in range(num_layers)]


def layer_indices(layer_types: list[str], kind: str) -> list[int]:
    return [i for i, t in enumerate(layer_types) if t == kind]


def _finish(
    path: str | Path,
    config: dict[str, Any],
    overrides: dict[str, Any] | None,
    with_tokenizer: bool,
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if overrides:
        config.update(overrides)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if with_tokenizer:
        write_tokenizer(path)
    return path


def _merge(base: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    if extra:
        base.update(extra)
    return base


def _gdn_fields(
    num_key_heads: int, num_value_heads: int, key_head_dim: int, value_head_dim: int
) -> dict[str, Any]:
    return {
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": key_head_dim,
        "linear_value_head_dim": value_head_dim,
        "linear_num_key_heads": num_key_heads,
        "linear_num_value_heads": num_value_heads,
    }


def qwen3_5_text(
    path: str | Path,
    *,
    num_layers: int = 8,
    mtp_layers: int = 1,
    full_attention_interval: int = 4,
    layer_types: list[str] | None = None,
    hidden_size: int = TINY_HIDDEN_SIZE,
    intermediate_size: int = 512,
    num_attention_heads: int = 12,
    num_kv_heads: int = 2,
    head_dim: int = 256,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 6,
    linear_key_head_dim: int = 128,
    linear_value_head_dim: int = 128,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    with_tokenizer: bool = False,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Tiny Qwen3.5 / Qwen3.6 (dense): Gated DeltaNet + gated full attention, MTP.

    vLLM 0.20.2 registers no text-only Qwen3.5 architecture (``Qwen3_5ForCausalLM``
    exists in models/qwen3_5.py but is not in the registry), so this is
    ``Qwen3_5ForConditionalGeneration`` / model_type ``qwen3_5`` with a
    ``text_config`` (``qwen3_5_text``) and a 1-block vision tower, as the real
    Qwen3.6-27B checkpoints ship. Use ``language_model_only=True`` to skip the
    vision tower at load time.

    Defaults (8 layers, interval 4): full attention at layers 3 and 7, GDN
    ("linear_attention") at 0, 1, 2, 4, 5, 6; one MTP layer (``mtp.layers.0``,
    always full attention). TurboQuant boundary skip for 8 layers is
    [0, 1, 6, 7], so layer 3 is the TurboQuant layer.

    Geometry kept from Qwen3.6-27B: head_dim 256, query:KV heads 6:1
    (24:4 there, 12:2 here), GDN head dims 128, GDN key:value heads 1:3 (16:48
    there, 2:6 here), partial rotary 0.25 with interleaved mrope.
    """
    if layer_types is None:
        layer_types = interval_layer_types(
            num_layers, full_attention_interval, "full_attention", "linear_attention"
        )
    assert len(layer_types) == num_layers
    text_config = {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attn_output_gate": True,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "full_attention_interval": full_attention_interval,
        "layer_types": layer_types,
        **_gdn_fields(
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
        ),
        "mtp_num_hidden_layers": mtp_layers,
        "mtp_use_dedicated_embeddings": False,
        "partial_rotary_factor": 0.25,
        # mrope_section covers head_dim * 0.25 / 2 = 32 rotary pairs for 256.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "qwen3_5",
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [],
    }
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": _merge(text_config, text_overrides),
        "vision_config": _merge(vision_config, vision_overrides),
        "image_token_id": SPECIAL_TOKENS["<|image_pad|>"],
        "video_token_id": SPECIAL_TOKENS["<|video_pad|>"],
        "vision_start_token_id": SPECIAL_TOKENS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_TOKENS["<|vision_end|>"],
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return _finish(path, config, overrides, with_tokenizer)


def qwen3_next(
    path: str | Path,
    *,
    num_layers: int = 8,
    mtp_layers: int = 1,
    full_attention_interval: int = 4,
    layer_types: list[str] | None = None,
    hidden_size: int = TINY_HIDDEN_SIZE,
    num_attention_heads: int = 16,
    num_kv_heads: int = 2,
    head_dim: int = 256,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 128,
    linear_value_head_dim: int = 128,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 128,
    shared_expert_intermediate_size: int = 128,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    with_tokenizer: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Tiny Qwen3-Next / Qwen3-Coder-Next: GDN + gated attention, all-MoE, MTP.

    ``Qwen3NextForCausalLM`` / model_type ``qwen3_next`` (text-only; vLLM parses
    it with its own ``Qwen3NextConfig``). MTP count is ``num_nextn_predict_layers``.

    Defaults (8 layers, interval 4): full attention at layers 3 and 7, GDN at
    0, 1, 2, 4, 5, 6; one MTP layer. TurboQuant boundary skip for 8 layers is
    [0, 1, 6, 7], so layer 3 is the TurboQuant layer.

    Geometry kept from Qwen3-Coder-Next-80B-A3B: head_dim 256, query:KV heads
    8:1 (16:2 in both), GDN head dims 128, GDN key:value heads 1:2 (16:32 there,
    2:4 here), shared expert, ``decoder_sparse_step`` 1 (every layer MoE).
    Experts shrink from 512 (10 active) to 8 (2 active).
    """
    if layer_types is None:
        layer_types = interval_layer_types(
            num_layers, full_attention_interval, "full_attention", "linear_attention"
        )
    assert len(layer_types) == num_layers
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        # Unused while every layer is MoE; kept for mlp_only_layers overrides.
        "intermediate_size": 512,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "full_attention_interval": full_attention_interval,
        "layer_types": layer_types,
        **_gdn_fields(
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
        ),
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_nextn_predict_layers": mtp_layers,
        "partial_rotary_factor": 0.25,
        "rope_theta": 5_000_000,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
    }
    return _finish(path, config, overrides, with_tokenizer)


def gemma4_mm(
    path: str | Path,
    *,
    num_layers: int = 12,
    sliding_window_pattern: int = 6,
    layer_types: list[str] | None = None,
    hidden_size: int = TINY_HIDDEN_SIZE,
    intermediate_size: int = 512,
    num_attention_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 256,
    global_head_dim: int = 512,
    num_global_kv_heads: int = 1,
    attention_k_eq_v: bool = True,
    sliding_window: int = 128,
    use_bidirectional_attention: str | None = "vision",
    vocab_size: int = TINY_VOCAB_SIZE,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    with_tokenizer: bool = False,
    text_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Tiny Gemma 4 multimodal (``Gemma4ForConditionalGeneration`` / ``gemma4``).

    Sliding-window layers use ``head_dim`` (256) and ``num_key_value_heads``;
    full-attention layers use ``global_head_dim`` (512) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``. These are the field
    names of the published Gemma 4 configs and the ones vLLM 0.20.2's
    gemma4.py reads. ``use_bidirectional_attention="vision"`` makes vLLM treat
    the model as an mm-prefix LM (TurboQuant Gate 1). No audio tower and no
    per-layer embeddings (``hidden_size_per_layer_input`` 0), like the 31B.

    Defaults (12 layers, 5 sliding : 1 full): full attention at layers 5 and
    11, sliding at 0-4 and 6-10. TurboQuant boundary skip for 12 layers is
    [0, 1, 10, 11], so layer 5 is the one full-attention TurboQuant layer.

    KV heads 4 (sliding) and 1 (global) are Gemma-4-31B's per-GPU counts at
    TP=4 (16 and 4 in total), the setup of the Gate-5 report; query:KV 2:1 on
    sliding layers as there.

    Note: transformers >= 5.15 turns ``global_head_dim`` /
    ``num_global_key_value_heads`` into a heterogeneous ``per_layer_config``,
    which vLLM 0.20.2 cannot read and patch 0010 can (see test_tiny_configs.py).
    """
    if layer_types is None:
        layer_types = interval_layer_types(
            num_layers, sliding_window_pattern, "full_attention", "sliding_attention"
        )
    assert len(layer_types) == num_layers
    text_config = {
        "model_type": "gemma4_text",
        "vocab_size": vocab_size,
        "vocab_size_per_layer_input": vocab_size,
        "hidden_size_per_layer_input": 0,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": num_global_kv_heads,
        "attention_k_eq_v": attention_k_eq_v,
        "layer_types": layer_types,
        "sliding_window": sliding_window,
        "use_bidirectional_attention": use_bidirectional_attention,
        "num_kv_shared_layers": 0,
        "enable_moe_block": False,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
    }
    vision_config = {
        "model_type": "gemma4_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 1024,
        # vLLM's processor sizes image placeholders from this (not in the
        # transformers dataclass, but present in published configs).
        "default_output_length": 280,
    }
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": _merge(text_config, text_overrides),
        "vision_config": _merge(vision_config, vision_overrides),
        "audio_config": None,
        "image_token_id": SPECIAL_TOKENS["<image_soft_token>"],
        "boi_token_id": SPECIAL_TOKENS["<start_of_image>"],
        "eoi_token_id": SPECIAL_TOKENS["<end_of_image>"],
        "video_token_id": SPECIAL_TOKENS["<video_soft_token>"],
        "audio_token_id": SPECIAL_TOKENS["<audio_soft_token>"],
        "boa_token_id": SPECIAL_TOKENS["<start_of_audio>"],
        "eoa_token_index": SPECIAL_TOKENS["<end_of_audio>"],
        "tie_word_embeddings": True,
        "dtype": dtype,
    }
    return _finish(path, config, overrides, with_tokenizer)


def write_gemma4_processor(path: str | Path, max_soft_tokens: int = 70) -> Path:
    """Write a local ``Gemma4Processor`` (image, video, audio parts) into ``path``.

    ``path`` must hold a tiny Gemma 4 written with ``with_tokenizer=True``; pass
    ``vision_overrides={"default_output_length": max_soft_tokens}`` to
    ``gemma4_mm`` so vLLM sizes image placeholders the same. 70 soft tokens is
    the smallest budget transformers' image processor accepts.
    """
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    path = Path(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    # The processor reads its placeholders from the tokenizer's named specials.
    tokenizer_config["extra_special_tokens"] = {
        "image_token": "<image_soft_token>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "audio_token": "<audio_soft_token>",
        "boa_token": "<start_of_audio>",
        "eoa_token": "<end_of_audio>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=max_soft_tokens),
        tokenizer=AutoTokenizer.from_pretrained(str(path)),
        video_processor=Gemma4VideoProcessor(),
        image_seq_length=max_soft_tokens,
        chat_template=tokenizer_config["chat_template"],
    )
    processor.save_pretrained(str(path))
    return path


def qwen3_dense(
    path: str | Path,
    *,
    num_layers: int = 6,
    hidden_size: int = TINY_HIDDEN_SIZE,
    intermediate_size: int = 512,
    num_attention_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    vocab_size: int = TINY_VOCAB_SIZE,
    max_position_embeddings: int = 4096,
    dtype: str = "bfloat16",
    with_tokenizer: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Tiny dense Qwen3 (``Qwen3ForCausalLM`` / ``qwen3``): standalone or draft.

    Stands in for Qwen3-4B and LocoOperator-4B (the dense draft of the
    dense-draft + hybrid-main report). All layers are full attention
    (0-5 by default); TurboQuant boundary skip for 6 layers is [0, 1, 4, 5],
    so layers 2 and 3 are TurboQuant layers.

    Geometry kept from Qwen3-4B: head_dim 128, query:KV heads 4:1 (32:8
    there, 8:2 here), tied embeddings.
    """
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 1_000_000,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": dtype,
    }
    return _finish(path, config, overrides, with_tokenizer)


# name -> builder, for parametrized tests and scripts.
BUILDERS = {
    "qwen3_5_text": qwen3_5_text,
    "qwen3_next": qwen3_next,
    "gemma4_mm": gemma4_mm,
    "qwen3_dense": qwen3_dense,
}
