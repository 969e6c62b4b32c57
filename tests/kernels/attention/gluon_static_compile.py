# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Gluon decode stage 1 compiled for a GPU architecture without a GPU.

Triton's compiler and its bundled ``ptxas`` build the kernel a launch of
``gluon_turboquant_decode.stage1`` would build, from the same compile-time
arguments (``_constexprs``), so tests and the compile report can read its
registers, spills and SASS on any host.
"""

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from vllm.v1.attention.ops import gluon_turboquant_decode as gluon_decode


def static_compile(
    head_dim: int,
    group: int,
    key_fp8: bool,
    mse_bits: int,
    key_packed_size: int,
    norm_correction: bool,
    token_bytes: int,
    arch: int = 90,
    word32: bool | None = None,
    value_bits: int = 4,
    key_tails: bool = True,
    shifted: bool | None = None,
    pairs: bool = False,
):
    """Stage 1 compiled for ``sm_<arch>`` without a GPU (tests, compile
    reports): bf16 queries and outputs, pages of 16 tokens ``token_bytes``
    apart (a cache's stride(1): KV heads x slot; a constant of the compiled
    kernel, and ptxas allocates registers differently per value), split,
    launched programmatically from sm_90 as ``stage1`` launches it.
    ``pairs``: 3-bit keys coded by pairs (``stage1``'s ``key_pairs``)."""
    # 32-bit words where the slots allow them (FP8 keys; 4-bit keys and
    # values at a token stride of whole words), as stage1() decides.
    word32 = key_fp8 if word32 is None else word32
    if shifted is None:
        shifted = gluon_decode._shiftable(head_dim, key_fp8, mse_bits, value_bits)
        shifted = shifted and token_bytes % 4 == 0
    constexprs = gluon_decode._constexprs(
        head_dim, group, 16, key_fp8, mse_bits, key_packed_size, norm_correction,
        word32, True, 256, value_bits, key_tails,
        token_bytes // gluon_decode._unit_bytes(word32 or shifted), arch >= 90, shifted,
        pairs=pairs,
    )  # fmt: skip
    pointers = dict(
        Q_ptr="*bf16" if key_fp8 else "*fp32",
        KV_ptr="*i32" if word32 else "*i16",
        Block_table_ptr="*i32",
        Seq_lens_ptr="*i32",
        Table_ptr="*i32",
        Out_ptr="*bf16",
        Mid_ptr="*fp32",
        qk_scale="fp32",
    )
    names = gluon_decode._stage1.arg_names
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names
    }
    # Pointers 16-byte aligned, as Triton specializes them at launch.
    aligned = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in pointers
        if n.endswith("_ptr")
    }
    return triton.compile(
        GluonASTSource(
            gluon_decode._stage1, signature, constexprs=constexprs, attrs=aligned
        ),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=constexprs["W"], maxnreg=gluon_decode.MAX_REGISTERS),
    )
