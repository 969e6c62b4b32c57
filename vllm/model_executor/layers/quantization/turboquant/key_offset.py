# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A per-KV-head key offset for TurboQuant's MSE keys, calibrated at start.

Trained models' post-RoPE keys share a large common component per head: on
SmolLM2-135M and Gemma-3-270M the mean key is as long as a typical key's
residual around it. TurboQuant codes each key as a direction times its norm,
so its error scales with the whole length; a 3-bit code spends its few
levels on the part every key shares, and retrieval of one old token suffers
first (3-bit needle recall 65 % against 95 % for 4 bits on SmolLM2).

Softmax ignores a score shift common to all keys of a query, so a key may be
stored as ``k - mu`` (``mu`` the layer's mean key for its KV head), scored as
``q . (k - mu)`` and attended with no other change. The attention sink is the
exception: a sequence's first key lies apart from the others, on SmolLM2
nearer the origin than the mean (shifting it would lengthen it), on Gemma 3
the other way. The store keeps that key the shorter way: shifted, or as it is
with its fp16 norm's sign bit set (a norm is never negative); the decodes
subtract ``q . mu`` from a marked key's score so that all scores carry the
same shift, and continuations add ``mu`` back to shifted keys. Every other
key is stored shifted. Deciding so for every key is as good in emulation
(benchmarks/quality/FINDINGS-3bit.md), but a key near the boundary would be
coded one way or the other by a rounding difference in its inputs (a
speculative verify row against a decode step), so an engine with speculation
and one without would store visibly different keys; a first key is stored by
the same prefill in both. No byte is added to the cache.

``mu`` comes from the model itself: the engine serves one prefill of
``CALIBRATION_TOKENS`` seeded random token ids before it accepts requests
(``vllm.v1.engine.key_offset_calibration``), while the layers average the
keys they store. Until then the offsets are zero, which stores exactly what
a layer without an offset stores. They are fixed for the engine's life, so
every request, batch and prefix-cache hit stores the same bytes.

3- and 4-bit MSE keys take it (FP8 keys are stored by another path, without
one). At 3 bits it recovers needles and perplexity; at 4 bits, most of the
perplexity 4-bit keys still lose on Gemma-3-270M
(benchmarks/quality/FINDINGS-3bit.md has both, in emulation and on a GPU).
"""

import torch
from torch import nn

import vllm.envs as envs
from vllm.logger import init_logger

logger = init_logger(__name__)

# The MSE key widths that take an offset.
OFFSET_KEY_BITS = (3, 4)
# The calibration prefill's longest length. A longer prompt averages RoPE's
# slowly turning pairs over more positions, but models differ in what that
# gains: on the GPU, 8,192 random ids against 2,048 took SmolLM2's 3-bit
# perplexity from 1.016x to 1.013x and Gemma 3's k3v4_nc from 1.026x to
# 1.062x (benchmarks/quality/FINDINGS-3bit.md).
CALIBRATION_TOKENS = 2048
CALIBRATION_SEED = 0


def layer_key_offset(layer: nn.Module | None) -> torch.Tensor | None:
    """The key offset ``bind_key_offsets`` gave ``layer`` ([Hk, D] fp32);
    None where its keys are stored unshifted."""
    return getattr(layer, "_tq_key_offset", None)


def fused_kernels_serve(impl) -> bool:
    """Whether a ``TurboQuantAttentionImpl``'s cache is written by the
    one-launch store and read by the split-KV decode: MSE keys at a
    power-of-two head_dim they serve, and not under
    ``VLLM_TURBOQUANT_DECODE=legacy`` (0.20.2's kernels read only what
    0.20.2 stores)."""
    from vllm.v1.attention.ops.triton_turboquant_decode_splitkv import supports
    from vllm.v1.attention.ops.turboquant_hadamard import rotates_in_registers

    cfg = impl.tq_config
    d = impl.head_size
    return (
        not cfg.key_fp8
        and cfg.key_mse_bits in (3, 4)
        and rotates_in_registers(d)
        and envs.VLLM_TURBOQUANT_DECODE != "legacy"
        and supports(
            d,
            impl.num_heads,
            impl.num_kv_heads,
            cfg.key_mse_bits,
            cfg.effective_value_quant_bits,
            False,
        )
    )


def takes_key_offset(impl) -> bool:
    """Whether a ``TurboQuantAttentionImpl``'s keys are stored with an
    offset: MSE keys of ``OFFSET_KEY_BITS`` in a layer ``fused_kernels_serve``
    (0.20.2's kernels cannot read the mark)."""
    return (
        not impl.tq_config.key_fp8
        and impl.tq_config.key_mse_bits in OFFSET_KEY_BITS
        and fused_kernels_serve(impl)
    )


def _on(tensor: torch.Tensor, device: torch.device | None) -> bool:
    """Whether ``tensor`` is on ``device`` (any index where it names none)."""
    if device is None:
        return True
    device = torch.device(device)
    return tensor.device.type == device.type and device.index in (
        None,
        tensor.device.index,
    )


def bind_key_offsets(model: nn.Module, device: torch.device | None = None) -> int:
    """Give every TurboQuant attention layer that ``takes_key_offset`` a zero
    offset (``layer._tq_key_offset``, on ``device`` where given) for the
    engine's calibration to fill in place; returns how many.

    Run once the weights are loaded, before CUDA graphs are captured: the
    graphs read the offsets where they are.
    """
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    bound = 0
    for module in model.modules():
        if not isinstance(module, Attention):
            continue
        impl = getattr(module, "impl", None)
        if not isinstance(impl, TurboQuantAttentionImpl) or not takes_key_offset(impl):
            continue
        shape = (impl.num_kv_heads, impl.head_size)
        offset = layer_key_offset(module)
        if offset is not None and offset.shape == shape and _on(offset, device):
            # Weights loaded again (a reload): captured CUDA graphs read this
            # tensor, so it is zeroed where it is, not replaced.
            offset.zero_()
        else:
            module._tq_key_offset = torch.zeros(
                shape, dtype=torch.float32, device=device
            )
        bound += 1
    if bound:
        logger.info_once(
            "TurboQuant: %d attention layers with MSE keys store them shifted by "
            "a per-KV-head key offset, calibrated once at start-up.",
            bound,
        )
    return bound


def stored_key_positions(layer: nn.Module, num_tokens: int) -> torch.Tensor | None:
    """The positions of the tokens whose keys ``layer`` stores in this step,
    from its attention metadata: the store keeps only a sequence's first key
    unshifted (a sink), and needs them to find it. None where the metadata
    has none (a drafter's own steps): there the store keeps any key the
    shorter way, which the decodes read as well."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(getattr(layer, "layer_name", None))
    positions = getattr(metadata, "positions", None)
    if positions is None or positions.dim() != 1:
        return None
    return positions[:num_tokens]


def observe_keys(layer: nn.Module, keys: torch.Tensor) -> None:
    """Add the keys a layer stores ([N, Hk, D], real tokens only) to its
    calibration sums while ``start_calibration`` has opened them, up to the
    calibration prompt's length: a prompt's keys are stored first, in order,
    and a step scheduled ahead (async scheduling, a drafter's verify rows)
    may store more, which would make the offsets depend on the engine's
    speculation and scheduling."""
    sums = getattr(layer, "_tq_key_sums", None)
    if sums is None:
        return
    take = min(keys.shape[0], sums[2] - sums[1])
    if take > 0:
        sums[0].add_(keys[:take].sum(0, dtype=torch.float64))
        sums[1] += take


def _offset_layers(worker) -> dict[str, nn.Module]:
    context = worker.vllm_config.compilation_config.static_forward_context
    return {
        name: layer
        for name, layer in context.items()
        if layer_key_offset(layer) is not None
    }


def start_calibration(worker, tokens: int) -> int:
    """Open the key sums of a worker's offset layers (main model and
    drafter) for the first ``tokens`` keys each stores; returns how many
    layers. Run through ``collective_rpc``."""
    layers = _offset_layers(worker)
    for layer in layers.values():
        offset = layer_key_offset(layer)
        layer._tq_key_sums = [torch.zeros_like(offset, dtype=torch.float64), 0, tokens]
    return len(layers)


def finish_calibration(worker) -> list[str]:
    """Set each offset layer's key offset to the mean of the keys it stored
    since ``start_calibration``, in place; returns the layers that stored
    none (their offsets stay zero). Run through ``collective_rpc``."""
    unseen = []
    for name, layer in _offset_layers(worker).items():
        sums = layer.__dict__.pop("_tq_key_sums", None)
        if sums is None or sums[1] == 0:
            unseen.append(name)
            continue
        layer_key_offset(layer).copy_((sums[0] / sums[1]).float())
    return unseen
