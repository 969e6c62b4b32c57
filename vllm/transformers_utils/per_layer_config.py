# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Read text configs whose attention shape differs per layer.

Gemma 4 has two attention shapes: sliding layers use ``head_dim`` and
``num_key_value_heads``, full layers ``global_head_dim`` and (with
``attention_k_eq_v``) ``num_global_key_value_heads``. transformers <= 5.14
stores them as those four attributes. From 5.15 on ``Gemma4TextConfig`` pops
``global_head_dim``/``num_global_key_value_heads`` into a heterogeneous
``per_layer_config`` that overrides ``head_dim``/``num_key_value_heads`` on the
full layers, and reading either attribute on the global config then raises
``AmbiguousGlobalPerLayerAttributeError`` (a ``RuntimeError``, so
``getattr(config, "head_dim", default)`` does not catch it).

The helpers below answer the same questions under both layouts, so callers do
not have to know which transformers is installed.
"""

from typing import Any

_MISSING = object()


def is_per_layer(config: Any) -> bool:
    """Whether ``config`` carries transformers' per-layer overrides."""
    # ``is_heterogeneous`` is a property of transformers >= 5.15 configs;
    # older configs (and vLLM's own config classes) lack it.
    return bool(getattr(config, "is_heterogeneous", False))


def layer_config(config: Any, layer_idx: int) -> Any:
    """The config of layer ``layer_idx``: global values plus its overrides.

    Without per-layer overrides this is ``config`` itself, so code written for
    the old layout (``global_head_dim`` etc.) keeps reading what it read.
    """
    if not is_per_layer(config):
        return config
    return config.per_layer_config[layer_idx]


def global_value(config: Any, name: str, default: Any = None) -> Any:
    """The global (not per-layer) value of ``name``, without the ambiguity error.

    For Gemma 4 the global ``head_dim``/``num_key_value_heads`` are the sliding
    layers' values under both layouts, which is what vLLM used them for.
    """
    if is_per_layer(config):
        value = config._getattr_without_heterogeneous_validation(name, _MISSING)
        return default if value is _MISSING else value
    return getattr(config, name, default)


def gemma4_layer_shape(config: Any, layer_idx: int) -> tuple[int, int]:
    """(head_dim, total KV heads) of Gemma 4 text layer ``layer_idx``."""
    if is_per_layer(config):
        layer = layer_config(config, layer_idx)
        return layer.head_dim, layer.num_key_value_heads
    head_dim = config.head_dim
    num_kv_heads = config.num_key_value_heads
    if config.layer_types[layer_idx] == "full_attention":
        head_dim = getattr(config, "global_head_dim", None) or head_dim
        if getattr(config, "attention_k_eq_v", False):
            num_kv_heads = (
                getattr(config, "num_global_key_value_heads", None) or num_kv_heads
            )
    return head_dim, num_kv_heads


def gemma4_head_dims(config: Any) -> tuple[int | None, int | None]:
    """(sliding head_dim, full head_dim) of a Gemma 4 text config.

    The second is ``None`` when the config has no full-attention layer and no
    ``global_head_dim`` (as ``getattr(config, "global_head_dim", None)`` was).
    """
    if not is_per_layer(config):
        return (
            getattr(config, "head_dim", None),
            getattr(config, "global_head_dim", None),
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    sliding = global_value(config, "head_dim")
    if "full_attention" not in layer_types:
        return sliding, None
    full = gemma4_layer_shape(config, layer_types.index("full_attention"))[0]
    return sliding, full


def configs_differ(a: Any, b: Any) -> bool:
    """``a != b`` for two transformers configs, per-layer ones included.

    transformers' dataclass ``__eq__`` reads every field of two configs of the
    same class, ``head_dim``/``num_key_value_heads`` too, and so raises on
    per-layer configs; e.g. vLLM compares an inner model's ``hf_config`` (a
    copy of the text config) with its ``hf_text_config``. Per-layer configs
    are compared by their serialized form, which holds the overrides.
    """
    if a is b:
        return False
    if not (is_per_layer(a) or is_per_layer(b)):
        return a != b
    return type(a) is not type(b) or a.to_dict() != b.to_dict()
