# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a TurboQuant layer holds, built for the kernel benchmarks as the
backend builds it: the presets and layer shapes timed, each preset's config,
centroids and rotation, the store's packed-slot constants, and the extra
arguments (key offset, rotated values) the backend gives a layer's kernels."""

import functools
import sys
import types
from pathlib import Path

import torch

PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
# Presets only a vLLM with hybridkv's patch 0034 has: timed where --presets
# names them.
OPT_IN_PRESETS = ["turboquant_3bit_pair_nc"]


PAGE = 16


# (label, query heads, KV heads, head_dim) of the layers the store and the
# read-back are timed on: one of each head_dim the decode cases cover.
LAYER_SHAPES = [
    ("Qwen3-4B", 32, 8, 128),
    ("Qwen3.6-27B", 24, 4, 256),
    ("Gemma4-31B-full", 32, 4, 512),
]


@functools.cache
def packed_slots():
    """The float64 decoding of packed slots and the preset-argument decode
    call that the kernel tests use too (tests/kernels/attention/
    turboquant_packed.py), from this checkout: run as a file, only the
    script's own folder is on sys.path. Loaded after the arguments are read:
    it imports vLLM, ~10 s that a mistyped flag should not wait for."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.kernels.attention import turboquant_packed

    return turboquant_packed


def store_kwargs(cfg):
    """The preset's packed-slot constants as the store kernels take them (the
    tests' definition, tests/kernels/attention/turboquant_store_args.py)."""
    return packed_slots().store_kwargs(cfg)


def tq_config(preset, head_dim):
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    return TurboQuantConfig.from_cache_dtype(preset, head_dim)


def add_presets_argument(parser) -> None:
    """``--presets``: vLLM 0.20.2's four by default, ``OPT_IN_PRESETS`` only
    when named."""
    parser.add_argument(
        "--presets",
        nargs="+",
        default=PRESETS,
        choices=PRESETS + OPT_IN_PRESETS,
        help=f"default: {' '.join(PRESETS)}; {' '.join(OPT_IN_PRESETS)} (patch "
        "0034) only when named",
    )


def codes_pairs(cfg) -> bool:
    """Whether the preset codes keys by pairs of coordinates (patch 0034):
    0.20.2's store and decode cannot read those."""
    return getattr(cfg, "key_pairs", False)


def tq_tables(cfg, head_dim, device="cuda"):
    """The centroids a TurboQuant layer holds (fp16 values, not the solver's),
    their midpoints, and the backend's own rotation matrix; for a preset that
    ``codes_pairs``, its 64 points twice (the store reads them too)."""
    from vllm.model_executor.layers.quantization.turboquant.fp16_centroids import (
        fp16_centroids,
    )
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

    # The backend's cached matrix itself, not an equal one: the decode knows
    # that object (``is_backend_hadamard``) and rotates the query in one
    # small kernel, as in an engine (``splitkv_call``).
    pit = _build_hadamard(head_dim, str(torch.device(device)))
    if codes_pairs(cfg):
        from vllm.model_executor.layers.quantization.turboquant.key_codebook import (
            key_codebook,
            store_codebook,
        )

        points = key_codebook(cfg, head_dim).to(device)
        return points, store_codebook(points), pit
    bits = cfg.key_mse_bits if not cfg.key_fp8 else cfg.centroid_bits
    centroids, _ = fp16_centroids(head_dim, bits).sort()
    midpoints = (centroids[:-1] + centroids[1:]) / 2
    return centroids.to(device), midpoints.to(device), pit


def takes_key_offset(cfg) -> bool:
    """Whether the backend stores this preset's keys with a key offset
    (patch 0027; False on a vLLM without it)."""
    try:
        from vllm.model_executor.layers.quantization.turboquant import key_offset
    except ImportError:
        return False
    return not cfg.key_fp8 and cfg.key_mse_bits in key_offset.OFFSET_KEY_BITS


def served_extras(cfg, hq: int, hk: int, D: int, device: str = "cuda") -> dict:
    """The arguments the backend adds to this preset's decode, by its own
    rules for a layer of this shape: a key offset for 3- and 4-bit MSE keys
    (0027), rotated values (0028); none on a vLLM without those patches."""
    try:
        from vllm.model_executor.layers.quantization.turboquant import (
            key_offset,
            value_rotation,
        )
    except ImportError:
        return {}
    layer = types.SimpleNamespace(
        tq_config=cfg, head_size=D, num_heads=hq, num_kv_heads=hk
    )
    extras = {}
    if key_offset.takes_key_offset(layer):
        extras["key_offset"] = torch.randn(hk, D, device=device)
    if value_rotation.rotates_values(layer):
        extras["value_rotation"] = True
    return extras
