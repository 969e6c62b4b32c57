# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV bytes of a recent raw window built as a sliding-window twin per
TurboQuant layer (benchmarks/quality/FINDINGS-3bit.md, "How the window could
be built"): bits per K/V element of the quantized layers, window included.

A twin is a model-dtype sliding-window layer beside each TurboQuant layer.
vLLM's hybrid allocator gives every layer the same page size, so the twin's
pages and the TurboQuant pages are unified; a request holds
``ceil((W - 1) / block) + 1`` twin blocks per layer whatever W is, and the
twin's block size, not W, sets what the window costs. Two layouts:

- ``vLLM``: the block sizes vLLM's own unification picks
  (``unify_kv_cache_spec_page_size``, the series' scale-then-pad rule);
- ``smallest twin block``: twin blocks of 16 tokens, the TurboQuant block the
  smallest multiple of 16 whose page holds one, the twin's page padded to it.

    python benchmarks/quality/raw_window_pages.py

Defaults: SmolLM2-135M's attention (30 layers, 3 KV heads of 64), the
quality harness's contexts. Runs on the CPU.
"""

import argparse
import math
import sys

BLOCK = 16  # vLLM's default block size, and the unit block sizes grow by


def _specs(layers, kv_heads, head_dim, preset, window, block_sizes=None):
    import torch

    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, TQFullAttentionSpec

    slot = TurboQuantConfig.from_cache_dtype(preset, head_dim).slot_size_aligned
    tq_block, raw_block = block_sizes or (BLOCK, BLOCK)
    # What a layer's K and V are, whichever cache holds them.
    heads = dict(
        num_kv_heads=kv_heads,
        head_size=head_dim,
        head_size_v=head_dim,
        dtype=torch.bfloat16,
    )
    specs = {}
    for i in range(layers):
        name = f"model.layers.{i}.self_attn.attn"
        specs[name] = TQFullAttentionSpec(
            block_size=tq_block, tq_slot_size=slot, **heads
        )
        if window:
            specs[name + "_raw"] = SlidingWindowSpec(
                block_size=raw_block, sliding_window=window, **heads
            )
    return specs


def _bits(specs, page, context, elements) -> float:
    """Bits per K/V element of the quantized layers: every block a request of
    ``context`` tokens holds, at the unified ``page`` size."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    blocks = 0
    for spec in specs.values():
        held = math.ceil(context / spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            held = min(held, math.ceil((spec.sliding_window - 1) / spec.block_size) + 1)
        blocks += held
    return 8 * blocks * page / (elements * context)


def layouts(layers, kv_heads, head_dim, preset, window):
    """(name, TQ block, twin block, page bytes, specs) of each layout."""
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size

    alone = _specs(layers, kv_heads, head_dim, preset, 0)
    first = next(iter(alone.values()))
    rows = [(f"{preset} alone", BLOCK, None, first.page_size_bytes, alone)]
    unified = unify_kv_cache_spec_page_size(
        _specs(layers, kv_heads, head_dim, preset, window)
    )
    tq = next(s for n, s in unified.items() if not n.endswith("_raw"))
    raw = next(s for n, s in unified.items() if n.endswith("_raw"))
    rows.append(("vLLM", tq.block_size, raw.block_size, tq.page_size_bytes, unified))
    raw_page = BLOCK * kv_heads * head_dim * 2 * 2  # K and V, bf16
    per_token = first.page_size_bytes // BLOCK
    tq_block = BLOCK * math.ceil(raw_page / (BLOCK * per_token))
    smallest = _specs(layers, kv_heads, head_dim, preset, window, (tq_block, BLOCK))
    page = max(tq_block * per_token, raw_page)
    rows.append(("smallest twin block", tq_block, BLOCK, page, smallest))
    return rows


def markdown(layers, kv_heads, head_dim, preset, window, contexts) -> str:
    elements = layers * kv_heads * head_dim * 2
    out = [
        f"{preset} on {layers} layers of {kv_heads} KV heads x {head_dim}, a "
        f"{window}-token bf16 twin per layer: bits per K/V element of the "
        "quantized layers, window included",
        "",
        "| layout | TQ block | twin block | page B | "
        + " | ".join(f"{c:,} tokens" for c in contexts)
        + " |",
        "|---" * (4 + len(contexts)) + "|",
    ]
    for name, tq_block, raw_block, page, specs in layouts(
        layers, kv_heads, head_dim, preset, window
    ):
        bits = " | ".join(f"{_bits(specs, page, c, elements):.3f}" for c in contexts)
        out.append(f"| {name} | {tq_block} | {raw_block or '-'} | {page:,} | {bits} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--preset", default="turboquant_3bit_nc", choices=list(TQ_PRESETS))
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    args = ap.parse_args(argv)
    for flag in ("layers", "kv_heads", "head_dim", "window"):
        if getattr(args, flag) < 1:
            ap.error(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected at least 1"
            )
    if min(args.contexts) < 1:
        ap.error(f"--contexts {min(args.contexts)}: expected at least 1")
    print(
        markdown(
            args.layers,
            args.kv_heads,
            args.head_dim,
            args.preset,
            args.window,
            args.contexts,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
