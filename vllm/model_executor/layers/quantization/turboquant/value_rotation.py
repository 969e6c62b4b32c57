# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which TurboQuant layers store their values Hadamard-rotated.

A TurboQuant value is coded by one min/max pair per (token, KV head): its
``2**bits`` levels span the vector's extremes, so one outlier coordinate
widens the step for every other one. Trained models' values have such
coordinates. Rotated by the normalized Hadamard matrix ``H`` (the one the
backend already rotates MSE keys with), a value's energy spreads over all
coordinates and its range shrinks towards the bulk: on Gemma-3-270M,
emulated on the CPU, 3-bit values went from 1.029x to 1.023x of ``auto``'s
perplexity (benchmarks/quality/FINDINGS-3bit.md).

``H`` is orthonormal and symmetric, so attention over rotated values is the
rotated attention: ``sum_i p_i (H v_i) = H sum_i p_i v_i``. The store codes
``H v``; the decode rotates its merged output back once per (row, head)
(``triton_turboquant_decode_splitkv``'s merge, after stage 1 wrote its
partial results) and continuations rotate the dequantized values back
before their attention. No byte is added: the bytes per token users plan
with are the preset's own.

The layers that do: MSE keys (the backend's Hadamard matrix exists there)
at a power-of-two head_dim the one-launch store and the split-KV decode
serve. Not FP8 keys (``turboquant_k8v4``), and not under
``VLLM_TURBOQUANT_DECODE=legacy``, whose 0.20.2 kernel writes its output
unrotated.
"""

from vllm.model_executor.layers.quantization.turboquant.key_offset import (
    fused_kernels_serve,
)


def rotates_values(impl) -> bool:
    """Whether a ``TurboQuantAttentionImpl`` stores its values rotated:
    where ``fused_kernels_serve`` (MSE keys, the one-launch store and the
    split-KV decode, not the legacy decode).

    Decided once per layer (the answer depends on its configuration and the
    process's ``VLLM_TURBOQUANT_DECODE``, fixed before the engine starts) and
    kept on it: the store, the decodes and continuations must agree.
    """
    known = getattr(impl, "_tq_rotates_values", None)
    if known is None:
        known = fused_kernels_serve(impl)
        impl._tq_rotates_values = known
    return known
