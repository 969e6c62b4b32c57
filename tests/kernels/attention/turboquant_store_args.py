# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A TurboQuant preset's packed-slot constants as keyword arguments, for the
tests and benchmarks that call the store kernels (and 0.20.2's decode)."""


def store_kwargs(cfg) -> dict:
    """``cfg``: a TurboQuantConfig."""
    return dict(
        mse_bits=cfg.key_mse_bits,
        key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits,
        key_fp8=cfg.key_fp8,
    )
