# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Lloyd-Max centroids a TurboQuant KV cache is quantized to, as fp16
values.

``get_centroids`` solves them in float32. Tensor-core dots read fp16
operands, so a decode kernel exact in float32 centroids needs each one as an
fp16 head plus an fp16 tail: two lookups and two dots per key chunk. Rounded
once, before the store picks codes against their midpoints, the centroids
the cache holds are fp16 values and one lookup and one dot read them exactly.
Rounding moves a centroid by at most 4.1e-4 of itself (head_dim 128-512, 3
and 4 bits) and keeps them symmetric about 0; the quantizer's mean squared
error on N(0, 1/d) coordinates changes by under 1e-5 of itself.
"""

import torch

from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids


def fp16_centroids(head_dim: int, bits: int) -> torch.Tensor:
    """``get_centroids(head_dim, bits)`` rounded to fp16 values (float32, a
    new tensor: the solver's cached one stays as it is)."""
    return get_centroids(head_dim, bits).half().float()
