# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant: a layer's most recent tokens also kept at the model dtype.

``--kv-cache-dtype-skip-layers recent:W`` gives every TurboQuant layer of the
main model a *twin*: a model-dtype sliding-window ``Attention`` of window
``W`` registered as the child ``<layer>.raw_window``, which never runs a
forward of its own. vLLM plans, allocates, frees (outside the window),
caches and preempts its blocks as it does any sliding-window layer's, and
the planner counts them the same way. The TurboQuant layer's store writes
every token to its packed cache as before and to the twin; a decode row of
length ``L`` reads ``[0, L - W)`` packed and ``[L - W, L)`` from the twin
(``triton_turboquant_raw_window``). On a trained model the 3-bit presets'
lost needles are mostly digits read back from the tokens just written
(benchmarks/quality/FINDINGS-3bit.md); the window keeps those at the model
dtype while the cache, prefix-cached blocks included, stays compressed.

The twin holds each token as the quantizer sees it before coding: the key
shifted by the layer's key offset, divided by its key scale and rotated, the
value rotated where the layer stores values rotated. Its scores are then in
the decode's own units, and its output joins the packed splits' in one merge.

Prefill and continuation chunks read earlier chunks packed, as without a
window. Speculative verify rows read their own last ``W`` positions, each
through its request's row of the twin's block table. The twin's sliding
window is ``W`` plus the speculative tokens: with asynchronous scheduling a
step is scheduled while the previous step's drafts still count as computed,
and vLLM frees the twin's blocks by that count. Refused where the hybrid KV
cache manager is off (a sliding-window layer then gets a full-length cache).
"""

from typing import Any

import torch

from vllm.model_executor.layers.quantization.turboquant.key_offset import (
    layer_key_offset,
)
from vllm.model_executor.layers.quantization.turboquant.key_scale import (
    layer_key_scale,
)
from vllm.model_executor.layers.quantization.turboquant.layer_policy import (
    RECENT_PREFIX,
    is_draft_layer,
    recent_window,
)
from vllm.model_executor.layers.quantization.turboquant.value_rotation import (
    rotates_values,
)
from vllm.v1.attention.ops.triton_turboquant_raw_window import RawWindow

TWIN_NAME = "raw_window"


class RawWindowConfigError(ValueError):
    """``recent:W`` with a configuration that cannot serve it."""


def check_config(vllm_config: Any, window: int) -> None:
    """Refuse ``recent:W`` where the twin cannot be served (module doc)."""
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise RawWindowConfigError(
            f"--kv-cache-dtype-skip-layers {RECENT_PREFIX}{window}: the hybrid KV "
            "cache manager is off (--disable-hybrid-kv-cache-manager, or a KV "
            "connector turned it off), so each layer's window would get a "
            "full-length cache at the model dtype. Leave the entry out, or keep "
            "the hybrid manager on."
        )


def twin_window(vllm_config: Any, window: int) -> int:
    """The twin's sliding window: ``W`` and the speculative tokens (module doc)."""
    spec = vllm_config.speculative_config
    return window + ((spec.num_speculative_tokens or 0) if spec is not None else 0)


def twin_name(layer_name: str) -> str:
    return f"{layer_name}.{TWIN_NAME}"


def build_twin(
    prefix: str,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int,
    kv_sharing_target_layer_name: str | None,
) -> Any:
    """The twin of the TurboQuant layer ``prefix`` (an ``Attention``), or
    None where the run has no ``recent:W`` entry, the layer shares another
    layer's cache or belongs to a drafter."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    vllm_config = get_current_vllm_config()
    cache_config = vllm_config.cache_config
    window = recent_window(cache_config.kv_cache_dtype_skip_layers)
    if not window or kv_sharing_target_layer_name is not None:
        return None
    model_config = vllm_config.model_config
    layers = model_config.hf_text_config.num_hidden_layers if model_config else None
    if is_draft_layer(prefix, layers):
        return None
    check_config(vllm_config, window)
    twin = Attention(
        num_heads,
        head_size,
        scale,
        num_kv_heads,
        cache_config=None,  # the model dtype, outside the TurboQuant policy
        quant_config=None,
        per_layer_sliding_window=twin_window(vllm_config, window),
        prefix=twin_name(prefix),
    )
    twin.recent_tokens = window
    twin.kv_dim = _kv_dim(twin)
    return twin


def _twin_context(layer: Any) -> tuple[Any, Any, torch.Tensor, Any] | None:
    twin = getattr(layer, TWIN_NAME, None)
    if twin is None:
        return None
    from vllm.model_executor.layers.attention.attention import get_attention_context

    meta, _, kv_cache, slot_mapping = get_attention_context(twin.layer_name)
    if meta is None or kv_cache.numel() == 0:  # a profile run
        return None
    return twin, meta, kv_cache, slot_mapping


def twin_kv(
    impl: Any, layer: Any, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` / ``value`` ([N, Hk, D]) as the quantizer of ``layer`` sees
    them before coding, in the model dtype."""
    if impl.tq_config.key_fp8:
        return key, value
    k = key.float()
    offset = layer_key_offset(layer)
    if offset is not None:
        k = k - offset
    scale = layer_key_scale(layer)
    if scale is not None:
        k = k / scale
    PiT = layer._tq_PiT
    v = value
    if rotates_values(impl):
        v = (value.float() @ PiT).to(value.dtype)
    return (k @ PiT).to(key.dtype), v


def store_twin(
    impl: Any, layer: Any, key: torch.Tensor, value: torch.Tensor, n: int
) -> None:
    """Write the step's first ``n`` tokens to ``layer``'s twin, if it has one."""
    ctx = _twin_context(layer)
    if ctx is None or ctx[3] is None:
        return
    twin, _, kv_cache, slot_mapping = ctx
    k, v = twin_kv(impl, layer, key[:n], value[:n])
    twin.impl.do_kv_cache_update(twin, k, v, kv_cache, slot_mapping[:n])


def _kv_dim(twin: Any) -> int:
    """The dimension of size 2 (key, value) in the twin backend's cache shape."""
    shape = twin.attn_backend.get_kv_cache_shape(1, 16, 1, 8)
    return list(shape).index(2)


def decode_window(layer: Any, attn_metadata: Any) -> RawWindow | None:
    """The raw window a decode of ``layer`` reads with the TurboQuant
    metadata ``attn_metadata``, or None (no twin, or a profile run). Decode
    rows come first in a step: without speculation row ``i`` is request
    ``i``; verify rows name theirs (``decode_requests``)."""
    ctx = _twin_context(layer)
    if ctx is None:
        return None
    twin, meta, kv_cache, _ = ctx
    key_cache, value_cache = kv_cache.unbind(twin.kv_dim)
    return RawWindow(
        key_cache,
        value_cache,
        meta.block_table,
        twin.recent_tokens,
        attn_metadata.decode_requests,
    )
