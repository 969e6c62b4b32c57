# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A per-channel key scale for TurboQuant's MSE keys, read from ``k_norm``.

TurboQuant quantizes each key as a direction (Hadamard-rotated, Lloyd-Max
coded) times its norm, so its error grows with the key's length and is
spread evenly over the channels. Models that normalize keys per head
(Gemma 3/4, Qwen3, Qwen3-Next/3.5) multiply the normalized key by a learned
per-channel weight; where a few of those weights are large (Gemma-3-270M:
|1 + w| up to 30 against a median near 1), a few channels carry most of the
key's length and every other channel's error is measured against them.

Storing ``k / s`` and attending with ``q * s`` leaves every score ``q . k``
unchanged for any positive ``s`` (the store and the query rotation apply it
in their kernels; dequantized keys are multiplied back). ``s`` here is the
expected magnitude of each key channel after the norm and RoPE: RoPE turns
each channel pair by a position-dependent angle, so the two channels of a
pair share the root mean square of their two weights; channels past the
rotary dimension keep their own. It is a function of the weights alone, so
every engine, batch and prefix-cache hit stores the same bytes.

Layers without such a norm (Llama, SmolLM2), with a norm over all heads at
once, or with FP8 keys get no scale and store exactly what they did.
"""

import torch
from torch import nn

from vllm.logger import init_logger

logger = init_logger(__name__)

# The smallest channel scale, relative to the scale's root mean square: a
# channel whose weights are ~0 carries ~nothing, and dividing it by ~0 would
# spend the quantizer's range on rounding noise.
MIN_RELATIVE_SCALE = 1e-2


def norm_multiplier(norm: nn.Module) -> torch.Tensor | None:
    """The per-channel factor ``norm`` multiplies its normalized input by.

    vLLM's ``GemmaRMSNorm`` (also Qwen3-Next's) multiplies by ``1 + weight``,
    ``RMSNorm`` by ``weight``; None for a norm without a weight vector.
    """
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if isinstance(norm, GemmaRMSNorm):
        return weight.detach().float() + 1.0
    if isinstance(norm, RMSNorm) and norm.has_weight:
        return weight.detach().float()
    return None


def key_channel_scale(
    multiplier: torch.Tensor, rotary_dim: int, is_neox_style: bool
) -> torch.Tensor:
    """``s`` for keys ``rope(multiplier * normalized)``: [head_dim] fp32, root
    mean square 1.

    ``rotary_dim`` channels are turned in pairs, ``(i, i + rotary_dim / 2)``
    in the NeoX style and ``(2i, 2i + 1)`` otherwise.
    """
    head_dim = multiplier.numel()
    if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim {rotary_dim} is not an even number of channels within "
            f"head_dim {head_dim}"
        )
    a = multiplier.float().abs()
    s = a.clone()
    if rotary_dim:
        rot = a[:rotary_dim]
        if is_neox_style:
            half = rotary_dim // 2
            pair = ((rot[:half] ** 2 + rot[half:] ** 2) / 2).sqrt()
            s[:rotary_dim] = torch.cat([pair, pair])
        else:
            pair = ((rot[0::2] ** 2 + rot[1::2] ** 2) / 2).sqrt()
            s[:rotary_dim] = pair.repeat_interleave(2)
    rms = s.pow(2).mean().sqrt()
    if not torch.isfinite(rms) or rms <= 0:
        return torch.ones_like(s)
    s = s / rms
    return s.clamp_min(MIN_RELATIVE_SCALE).contiguous()


def _attention_key_scale(module: nn.Module, head_dim: int) -> torch.Tensor | None:
    """The scale for the keys ``module`` (an attention block with ``k_norm``
    and ``rotary_emb``) hands its attention layer, or None."""
    norm = getattr(module, "k_norm", None)
    multiplier = None if norm is None else norm_multiplier(norm)
    if multiplier is None or multiplier.numel() != head_dim:
        return None
    rope = getattr(module, "rotary_emb", None)
    rotary_dim = getattr(rope, "rotary_dim", None)
    is_neox = getattr(rope, "is_neox_style", None)
    if rope is None:
        rotary_dim, is_neox = 0, True
    elif not isinstance(rotary_dim, int) or not isinstance(is_neox, bool):
        return None
    return key_channel_scale(multiplier, rotary_dim, is_neox)


def layer_key_scale(layer: nn.Module) -> torch.Tensor | None:
    """The key scale ``bind_key_scales`` gave ``layer``; None where its keys
    are stored unscaled."""
    return getattr(layer, "_tq_key_scale", None)


def bind_key_scales(model: nn.Module, device: torch.device | None = None) -> int:
    """Give every TurboQuant attention layer with MSE keys under a per-head
    ``k_norm`` its key scale (``layer._tq_key_scale``, on ``device`` where
    given); returns how many.

    Run once the weights are loaded. The attention layer is the block's
    ``attn`` child, as in every vLLM model that has ``k_norm``. ``device``
    is where the layer runs: with weights offloaded to the CPU the norm's
    weight is not, and the kernels read the scale next to the cache.
    """
    from vllm.model_executor.layers.attention import Attention

    bound = 0
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        if not isinstance(attn, Attention) or not str(
            getattr(attn, "kv_cache_dtype", "")
        ).startswith("turboquant"):
            continue
        from vllm.v1.attention.backends.turboquant_attn import (
            TurboQuantAttentionImpl,
        )

        impl = getattr(attn, "impl", None)
        if not isinstance(impl, TurboQuantAttentionImpl) or impl.tq_config.key_fp8:
            continue
        scale = _attention_key_scale(module, impl.head_size)
        if scale is None:
            continue
        attn._tq_key_scale = scale if device is None else scale.to(device)
        bound += 1
        logger.debug(
            "%s: TurboQuant key scale from k_norm, max/min %.3g",
            name,
            (scale.max() / scale.min()).item(),
        )
    if bound:
        logger.info_once(
            "TurboQuant: %d attention layers store keys divided by a per-channel "
            "scale read from their k_norm weight (scores unchanged).",
            bound,
        )
    return bound
