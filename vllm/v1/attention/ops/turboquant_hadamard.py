# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The TurboQuant backend's rotation as a transform in registers.

The backend rotates MSE keys (and decode queries) by the Sylvester Hadamard
matrix scaled by ``1/sqrt(D)`` (``turboquant_attn._build_hadamard``). A
kernel that knows it is that matrix applies ``log2(D)`` add/subtract stages
instead of reading a ``D x D`` matrix: ``_hadamard_rows`` (``_hadamard_tile``
for several rows a program). Whether a given
matrix is that one is ``is_backend_hadamard``'s question.
"""

import torch

from vllm.triton_utils import tl, triton


@triton.jit
def _hadamard_rows(x, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Unnormalized Sylvester Hadamard transform of a [D] vector.

    Each stage pairs neighbours (the lowest index bit), writes sums to the
    first half and differences to the second: the index bits rotate right
    by one, so after log2(D) stages every bit was paired once and the order
    is natural again.
    """
    for _ in tl.static_range(LOG2_D):
        a, b = tl.split(tl.reshape(x, [D // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (1, 0)), [D])
    return x


@triton.jit
def _hadamard_tile(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """``_hadamard_rows`` of each row of a [ROWS, D] tile, in the same stages."""
    for _ in tl.static_range(LOG2_D):
        a, b = tl.split(tl.reshape(x, [ROWS, D // 2, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [ROWS, D])
    return x


def rotates_in_registers(head_dim: int) -> bool:
    """Whether the in-register transform (``_hadamard_rows``,
    ``_hadamard_tile``) takes this head size: a power of two from 16."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


# data_ptr of the backend's Hadamard matrix per (head_dim, device name).
_hadamard_ptrs: dict[tuple[int, str], int] = {}


def is_backend_hadamard(PiT: torch.Tensor | None) -> bool:
    """Whether ``PiT`` is the TurboQuant backend's own rotation matrix.

    The backend rotates with the cached scaled Sylvester Hadamard matrix of
    ``turboquant_attn._build_hadamard``; that object, and no other matrix,
    may be replaced by an in-register transform. Identity,
    not values: comparing values would sync with the GPU. Looking the matrix
    up may build it (a copy to the GPU), which a CUDA graph capture forbids:
    while capturing, only lookups made before count (vLLM's warm-up runs
    make them); otherwise the GEMM path runs, which is correct, only slower.
    """
    if PiT is None or PiT.dim() != 2 or PiT.shape[0] != PiT.shape[1]:
        return False
    if not rotates_in_registers(PiT.shape[0]):
        return False
    D = PiT.shape[0]
    # A matrix found before: its address alone names it (the backend's
    # matrices are kept for the process's life, and addresses are unique
    # across devices). Naming the device each call cost ~2 µs of a decode's
    # host time.
    ptr = PiT.data_ptr()
    for (d, _), known in _hadamard_ptrs.items():
        if known == ptr and d == D:
            return True
    capturing = PiT.is_cuda and torch.cuda.is_current_stream_capturing()
    for name in {str(PiT.device), PiT.device.type}:
        key = (D, name)
        if key not in _hadamard_ptrs:
            if capturing:
                continue
            from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

            _hadamard_ptrs[key] = _build_hadamard(D, name).data_ptr()
        if ptr == _hadamard_ptrs[key]:
            return True
    return False
