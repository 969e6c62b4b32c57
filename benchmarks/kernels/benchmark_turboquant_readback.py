# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant read-back: a continuation's cached K/V in the model dtype,
the per-pass path against the one launch, in one process, checked.

    python benchmarks/kernels/benchmark_turboquant_readback.py --quick

A prefill chunk that continues a prompt (a prefix-cache hit, a long prompt's
later chunk) attends to its cached tokens through FlashAttention over packed
bf16 K/V, so every layer first reads those tokens back from the TurboQuant
cache. For each shape (KV heads x head_dim), cached length and preset this
times both ways of doing it, as the backend calls them with a Qwen3-like
layer's flags (key scale on MSE keys; key offset and rotated values where the
backend's own rules give them):

- ``passes``: ``_dequantize_cached``, 0.20.2's dequantization kernel followed
  by the rotation, scale, offset, casts and copy as passes of their own;
- ``one launch``: ``unpack_cached`` (patch 0019), which ``cached_kv_into``
  takes wherever it serves;
- ``held again``: the one launch once more into the same rows with the map
  of the tiles they hold (``held``), as a second prefix-cache hit on the same
  blocks reads back in the same step: every tile is skipped, so this is what
  the check costs.

Each is timed by the kernel benchmarks' ``Timer`` (gpu_timer.py): ``GPU`` is
the median of CUDA events with L2 flushed and the launch hidden behind a GPU
sleep, ``host`` the median time the Python call takes to return (prefill
steps run eagerly, so both count). The floor is the bytes the read-back must
move (the packed slots read, bf16 K and V written) over the copy bandwidth
measured in this run. ``diff`` is max |one launch - passes| / max |passes| over K and V.

Writes readback-<time>.json and .md to --out DIR, else $OUT, else
benchmarks/runs/ (git-ignored).
"""

import functools
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_run import sweep_main  # noqa: E402
from turboquant_layer_setup import (  # noqa: E402
    LAYER_SHAPES,
    PAGE,
    served_extras,
    store_kwargs,
    tq_config,
    tq_tables,
)

SHAPES = LAYER_SHAPES
CACHED = [2048, 8192]
QUICK_SHAPES = SHAPES[:2]
QUICK_CACHED = [8192]


def readback_bytes(cached: int, hk: int, head_dim: int, slot: int) -> int:
    """What a read-back must move: each cached token's packed slot read once,
    its bf16 key and value written once, per KV head."""
    return cached * hk * (slot + 2 * head_dim * 2)


def filled_cache(
    cfg, hk, D, cached, pit, midpoints, extras, device="cuda", dtype=torch.bfloat16
):
    """A paged cache holding ``cached`` random tokens stored as the backend
    stores them with ``extras``, on shuffled pages; and the request's block
    row as the backend hands it over."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.attention.backends.turboquant_prefill_batch import (
        aligned_block_row,
    )
    from vllm.v1.attention.ops.triton_turboquant_store_fused import (
        turboquant_store,
    )

    g = torch.Generator(device=device).manual_seed(0)
    blocks = cdiv(cached, PAGE) + 1  # block 0 is vLLM's null block
    cache = torch.zeros(
        blocks, PAGE, hk, cfg.slot_size_aligned, dtype=torch.uint8, device=device
    )
    k = torch.randn(cached, hk, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(cached, hk, D, device=device, dtype=dtype, generator=g)
    pages = torch.randperm(blocks - 1, device="cpu") + 1
    row = pages.to(torch.int32).to(device)[None]
    pos = torch.arange(cached, device=device)
    slots = (row[0, pos // PAGE].long() * PAGE + pos % PAGE).to(torch.int32)
    store_extras = dict(extras)
    if "key_offset" in extras:
        store_extras["positions"] = pos % 64
    turboquant_store(
        k, v, cache, slots, pit, midpoints, **store_kwargs(cfg), **store_extras
    )
    return cache, aligned_block_row(row, 0)


def layer_extras(cfg, hq, hk, D, device="cuda") -> dict:
    """The read-back's flags for a Qwen3-like layer of this shape: a key
    scale on MSE keys (their k_norm, patch 0024) and what ``served_extras``
    gives (key offset, rotated values)."""
    extras = served_extras(cfg, hq, hk, D, device)
    if not cfg.key_fp8:
        g = torch.Generator(device=device).manual_seed(1)
        extras["key_scale"] = 0.5 + torch.rand(D, device=device, generator=g)
    return extras


def read_back_in_passes(impl, cache, row, cached, centroids, pit, k_out, v_out, extras):
    from vllm.v1.attention.backends.turboquant_prefill_batch import (
        _dequantize_cached,
    )

    k, v = _dequantize_cached(
        impl, cache, row, cached, pit, centroids, k_out.dtype, **extras
    )
    k_out[:cached] = k
    v_out[:cached] = v


def read_back_in_one_launch(
    impl, cache, row, cached, centroids, pit, k_out, v_out, extras, **held
):
    from vllm.v1.attention.ops.triton_turboquant_unpack_cached import unpack_cached

    cfg = impl.tq_config
    unpack_cached(
        cache, row, cached, centroids, pit, k_out, v_out,
        cfg.key_mse_bits, cfg.effective_value_quant_bits, cfg.key_fp8,
        cfg.norm_correction, **extras, **held,
    )  # fmt: skip


def bench(
    shapes, lengths, presets, timer, bw, rows, log, device="cuda", dtype=torch.bfloat16
):
    from vllm.v1.attention.ops.triton_turboquant_unpack_cached import BLOCK_N
    from vllm.v1.attention.ops.turboquant_hadamard import rotates_in_registers

    for label, hq, hk, D in shapes:
        for preset in presets:
            cfg = tq_config(preset, D)
            centroids, midpoints, pit = tq_tables(cfg, D, device)
            extras = layer_extras(cfg, hq, hk, D, device)
            impl = types.SimpleNamespace(head_size=D, tq_config=cfg)
            for cached in lengths:
                cache, row = filled_cache(
                    cfg, hk, D, cached, pit, midpoints, extras, device, dtype
                )
                k_out = torch.empty(cached, hk, D, dtype=dtype, device=device)
                v_out = torch.empty_like(k_out)

                args = (impl, cache, row, cached, centroids, pit, k_out, v_out)
                passes = functools.partial(read_back_in_passes, *args, extras)
                one_launch = functools.partial(read_back_in_one_launch, *args, extras)
                nbytes = readback_bytes(cached, hk, D, cfg.slot_size_aligned)
                r = dict(
                    shape=f"{label} {hk}x{D}",
                    cached=cached,
                    kv=preset.removeprefix("turboquant_"),
                    bytes=nbytes,
                    floor_us=nbytes / bw * 1e6,
                    flags=sorted(extras),
                )
                r["old_us"] = timer(passes)
                r["old_host_us"] = timer.host_us
                ref = (k_out.float().clone(), v_out.float().clone())
                if rotates_in_registers(D):
                    k_out.fill_(float("nan"))
                    v_out.fill_(float("nan"))
                    one_launch()
                    # torch's max, not Python's: a row left NaN must show.
                    r["diff"] = (
                        torch.stack(
                            [
                                (got.float() - want).abs().max() / want.abs().max()
                                for got, want in ((k_out, ref[0]), (v_out, ref[1]))
                            ]
                        )
                        .max()
                        .item()
                    )
                    r["new_us"] = timer(one_launch)
                    r["new_host_us"] = timer.host_us
                    held = torch.full(
                        (cached // BLOCK_N + 2, hk),
                        -1,
                        dtype=torch.int32,
                        device=device,
                    )
                    again = functools.partial(one_launch, held=held, row0=0)
                    again()
                    written = k_out.clone()
                    r["held_us"] = timer(again)
                    r["held_host_us"] = timer.host_us
                    if not torch.equal(k_out, written):
                        raise AssertionError(
                            f"{r['shape']} {preset}: a read-back into rows that "
                            "hold its tiles changed them"
                        )
                rows.append(r)
                log(fmt(r))


def us(x):
    return "n/a" if x is None else f"{x:,.1f}"


def ratio(a, b):
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def fmt(r):
    new = r.get("new_us")
    at = "n/a" if new is None else f"{r['floor_us'] / new:.0%}"
    return (
        f"  {r['shape']:22s} {r['cached']:5d} cached {r['kv']:8s} floor "
        f"{us(r['floor_us']):>6s} | passes {us(r['old_us']):>7s} "
        f"(host {us(r['old_host_us'])}) | one launch {us(new):>7s} "
        f"(host {us(r.get('new_host_us'))}) | held again "
        f"{us(r.get('held_us')):>5s} | {ratio(r['old_us'], new)}, "
        f"{at} of copy bandwidth | diff {r.get('diff', float('nan')):.1e}"
    )


def markdown(meta, rows):
    out = [
        f"# TurboQuant read-back microbenchmark ({meta['time']})",
        "",
        (
            f"Device: {meta['device']}; torch {meta['torch']}, "
            f"triton {meta['triton']}, vLLM {meta['vllm']}; copy bandwidth "
            f"{meta['copy_bandwidth_gbs']:,.0f} GB/s. GPU µs = median of CUDA "
            "events, L2 flushed, launch hidden behind a GPU sleep; host µs = "
            "median time the call takes to return. passes = `_dequantize_cached` "
            "(0.20.2's dequantization and a pass per step), one launch = "
            "`unpack_cached` (patch 0019); held again = the one launch into rows "
            "that hold its tiles (a second hit on the same blocks). Floor = "
            "packed slots read + bf16 K/V "
            "written, over the copy bandwidth. diff = max |one launch - passes| "
            "/ max |passes|."
        ),
        "",
        (
            "| shape | cached | KV | flags | floor | passes GPU | passes host "
            "| one launch GPU | one launch host | held again GPU | GPU ratio "
            "| % of copy bw | diff |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        new = r.get("new_us")
        at = "n/a" if new is None else f"{r['floor_us'] / new:.0%}"
        diff = "n/a" if "diff" not in r else f"{r['diff']:.1e}"
        out.append(
            f"| {r['shape']} | {r['cached']} | {r['kv']} | "
            f"{', '.join(r['flags']) or '-'} | {us(r['floor_us'])} | "
            f"{us(r['old_us'])} | {us(r['old_host_us'])} | {us(new)} | "
            f"{us(r.get('new_host_us'))} | {us(r.get('held_us'))} | "
            f"{ratio(r['old_us'], new)} | "
            f"{at} | {diff} |"
        )
    return "\n".join(out) + "\n"


def main():
    sweep_main(
        __doc__,
        "2 shapes x 8,192 cached tokens",
        "readback",
        bench,
        markdown,
        full=(SHAPES, CACHED),
        quick=(QUICK_SHAPES, QUICK_CACHED),
    )


if __name__ == "__main__":
    main()
