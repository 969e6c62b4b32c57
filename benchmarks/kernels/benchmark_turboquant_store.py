# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant store: 0.20.2's launcher vs the one-launch store (patch 0016)
vs bf16's ``reshape_and_cache_flash``, in one process, checked on the GPU.

    python benchmarks/kernels/benchmark_turboquant_store.py --quick

For each shape (KV heads x head_dim), token count and preset it prints the
median time of each store (CUDA events, L2 flushed before every call) twice:
``eager`` (Python + every launch, as prefill/mixed steps run the store: it is
a splitting op) and ``graph`` (the same call captured in a CUDA graph and
replayed, as FULL decode graphs run it: GPU time only), the floor (bytes
moved / copy bandwidth measured in this run) and a correctness check of both
TurboQuant stores against a float64 quantizer on the same random bf16 K/V:
key indices that differ from float64 farther than 1e-6 from a bucket midpoint
(must be 0), slots byte-identical to 0.20.2's, value bytes identical.
Keys/values are strided views of one ``qkv`` row, as the model passes them.
The one-launch store is also timed as served: with the arguments the backend
adds for the preset at that head size (a key offset with the tokens'
positions, rotated values; ``served_extras``), which change its bytes, so
only the plain call is checked.

Writes store-<time>.json and .md to --out DIR, else $OUT, else benchmarks/runs/
(git-ignored).
"""

import functools
import math
import os
import sys
import time

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
TOKENS = [1, 64, 512, 8192]
QUICK_SHAPES = SHAPES[:2]
QUICK_TOKENS = [64, 8192]
NEAR = 1e-6
CHECK_TOKENS = 512  # float64 check on the first tokens (host memory)


def qkv_views(n, hq, hk, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(
        n, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16, generator=g
    )
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d :].view(n, hk, d)
    return k, v


def graphed(fn):
    """fn captured in a CUDA graph; returns the replay callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def check(cfg, k, midpoints, slots, caches, d):
    """Per store: index flips vs float64 away from ties, and byte equality."""
    mse = not cfg.key_fp8
    s = slots.long()
    rows = {
        name: c[s // PAGE, s % PAGE].cpu() for name, c in caches.items()
    }  # [n, hk, slot]
    kps = cfg.key_packed_size
    res = dict(
        same_slots=(rows["new"] == rows["old"]).all(-1).float().mean().item(),
        same_values=bool(torch.equal(rows["new"][..., kps:], rows["old"][..., kps:])),
    )
    if not mse:
        return res
    k64 = k.double().cpu()
    h = torch.tensor([[1.0]], dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    y = (k64 / (k64.norm(dim=-1, keepdim=True) + 1e-8)) @ (h / math.sqrt(d))
    mids = midpoints.double().cpu()
    ref = torch.bucketize(y, mids, right=True)
    gap = (y[..., None] - mids).abs().min(-1).values
    bits = cfg.key_mse_bits
    nbytes = math.ceil(d * bits / 8)
    for name, r in rows.items():
        b = r[..., :nbytes].long()
        if bits == 4:
            idx = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)
        else:
            w = b.view(*b.shape[:-1], d // 8, 3)
            word = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16)
            idx = ((word[..., None] >> (torch.arange(8) * 3)) & 7).flatten(-2)
        wrong = idx != ref
        res[f"{name}_flips_far"] = int((wrong & (gap > NEAR)).sum())
        res[f"{name}_flips_near"] = int((wrong & (gap <= NEAR)).sum())
    return res


def bench(shapes, tokens, presets, timer, bw, rows, log):
    from vllm._custom_ops import reshape_and_cache_flash
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    try:
        from vllm.v1.attention.ops.triton_turboquant_store_fused import (
            turboquant_store,
        )
    except ImportError:
        turboquant_store = None
        log("  the installed vLLM has no one-launch store (patch 0016): old only")

    for label, hq, hk, d in shapes:
        for n in tokens:
            num_blocks = math.ceil(n / PAGE) * 2 + 1
            k, v = qkv_views(n, hq, hk, d)
            slots = torch.randperm(num_blocks * PAGE, device="cuda")[:n]
            kc = torch.empty(num_blocks, PAGE, hk, d, device="cuda", dtype=k.dtype)
            vc = torch.empty_like(kc)
            one = torch.ones((), device="cuda")
            bf16 = functools.partial(
                reshape_and_cache_flash, k, v, kc, vc, slots, "auto", one, one
            )
            in_bytes = n * hk * d * 2 * 2
            bf16_row = dict(
                shape=f"{label} {hk}x{d}",
                tokens=n,
                kv="bf16",
                bytes=2 * in_bytes,
                floor_us=2 * in_bytes / bw * 1e6,
                old_eager=timer(bf16),
                old_graph=timer(graphed(bf16)),
            )
            rows.append(bf16_row)
            log(fmt(bf16_row))
            for preset in presets:
                t0 = time.time()
                cfg = tq_config(preset, d)
                _, midpoints, pit = tq_tables(cfg, d)
                nbytes = in_bytes + n * hk * cfg.slot_size_aligned
                caches, row = (
                    {},
                    dict(
                        shape=f"{label} {hk}x{d}",
                        tokens=n,
                        kv=preset.removeprefix("turboquant_"),
                        bytes=nbytes,
                        floor_us=nbytes / bw * 1e6,
                        bf16_eager=bf16_row["old_eager"],
                        bf16_graph=bf16_row["old_graph"],
                    ),
                )
                for name, fn in (
                    ("old", triton_turboquant_store),
                    ("new", turboquant_store),
                ):
                    if fn is None:
                        continue
                    cache = torch.full(
                        (num_blocks, PAGE, hk, cfg.slot_size_aligned),
                        0xA5,
                        dtype=torch.uint8,
                        device="cuda",
                    )
                    run = functools.partial(
                        fn,
                        k,
                        v,
                        cache,
                        slots,
                        pit,
                        midpoints,
                        **store_kwargs(cfg),
                    )
                    try:
                        run()
                        torch.cuda.synchronize()
                        caches[name] = cache.clone()
                        row[f"{name}_eager"] = timer(run)
                        row[f"{name}_graph"] = timer(graphed(run))
                        if name == "new":
                            row.update(time_served(timer, run, cfg, hq, hk, d, n))
                    except Exception as e:  # noqa: BLE001 - keep the table going
                        log(f"  {name} {label} {preset}: {type(e).__name__}: {e}")
                if "old" in caches and "new" in caches:
                    m = min(n, CHECK_TOKENS)
                    row.update(check(cfg, k[:m], midpoints, slots[:m], caches, d))
                row["wall_s"] = round(time.time() - t0, 1)
                rows.append(row)
                log(fmt(row))


def time_served(timer, run, cfg, hq, hk, d, n, device="cuda") -> dict:
    """The store with the arguments the backend adds for this preset and
    head size (0027's key offset with the tokens' positions, 0028's rotated
    values); where it adds none, the plain call's times are the served ones."""
    extras = served_extras(cfg, hq, hk, d, device)
    if not extras:
        return dict(served_same_call=True)
    if "key_offset" in extras:
        extras["positions"] = torch.arange(n, device=device)
    served = functools.partial(run, **extras)
    return dict(served_eager=timer(served), served_graph=timer(graphed(served)))


def served(r, mode):
    """The store as served, in ``mode`` (eager or graph): its own time, or
    the plain call's where the backend adds nothing to it."""
    if r.get("served_same_call"):
        return r.get(f"new_{mode}")
    return r.get(f"served_{mode}")


def us(x):
    return "n/a" if x is None else f"{x:,.1f}"


def fmt(r):
    if r["kv"] == "bf16":
        return (
            f"  {r['shape']:20s} {r['tokens']:5d} tok bf16      floor "
            f"{us(r['floor_us']):>6s} | eager {us(r['old_eager']):>7s} | "
            f"graph {us(r['old_graph']):>7s}"
        )
    ok = (
        "n/a"
        if "same_slots" not in r
        else (
            f"same slots {r['same_slots']:.2%}, values "
            f"{'equal' if r['same_values'] else 'DIFFER'}"
            + (
                f", flips far old/new {r['old_flips_far']}/{r['new_flips_far']}"
                f", near {r['old_flips_near']}/{r['new_flips_near']}"
                if "new_flips_far" in r
                else ""
            )
        )
    )
    return (
        f"  {r['shape']:20s} {r['tokens']:5d} tok {r['kv']:9s} floor "
        f"{us(r['floor_us']):>6s} | eager old {us(r.get('old_eager')):>7s} "
        f"new {us(r.get('new_eager')):>7s} served {us(served(r, 'eager')):>7s} "
        f"bf16 {us(r['bf16_eager']):>6s} | graph old {us(r.get('old_graph')):>7s} "
        f"new {us(r.get('new_graph')):>7s} served {us(served(r, 'graph')):>7s} "
        f"bf16 {us(r['bf16_graph']):>6s} | {ok}"
    )


def markdown(meta, rows):
    out = [
        f"# TurboQuant store microbenchmark ({meta['time']})",
        "",
        (
            f"Device: {meta['device']}; torch {meta['torch']}, "
            f"triton {meta['triton']}, vLLM {meta['vllm']}; copy bandwidth "
            f"{meta['copy_bandwidth_gbs']:,.0f} GB/s. "
            "µs = median of CUDA events, L2 flushed before each call; eager = Python "
            "+ launches; graph = the call replayed from a CUDA graph (GPU time). "
            "old = 0.20.2's `triton_turboquant_store`, new = patch 0016's "
            "`turboquant_store`; as served = new with the arguments the backend "
            "adds for the preset (key offset with positions, rotated values), new "
            "itself where it adds none. Flips = key indices differing from float64 "
            "farther than 1e-6 from a midpoint (far, must be 0) / within it (near)."
        ),
        "",
        (
            "| shape | tokens | KV | floor | eager old | eager new | eager as served "
            "| eager bf16 | graph old | graph new | graph as served | graph bf16 "
            "| new/bf16 graph | as served/bf16 graph | same slots | values "
            "| flips far old/new | near old/new |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["kv"] == "bf16":
            continue
        ng, sg, bg = r.get("new_graph"), served(r, "graph"), r.get("bf16_graph")
        same = f"{r['same_slots']:.2%}" if "same_slots" in r else "n/a"
        values = "n/a"
        if "same_values" in r:
            values = "equal" if r["same_values"] else "DIFFER"
        out.append(
            f"| {r['shape']} | {r['tokens']} | {r['kv']} | {us(r['floor_us'])} | "
            f"{us(r.get('old_eager'))} | {us(r.get('new_eager'))} | "
            f"{us(served(r, 'eager'))} | {us(r['bf16_eager'])} | "
            f"{us(r.get('old_graph'))} | {us(ng)} | {us(sg)} | {us(bg)} | "
            f"{f'{ng / bg:.2f}x' if ng and bg else 'n/a'} | "
            f"{f'{sg / bg:.2f}x' if sg and bg else 'n/a'} | "
            f"{same} | {values} | "
            f"{r.get('old_flips_far', '-')}/{r.get('new_flips_far', '-')} | "
            f"{r.get('old_flips_near', '-')}/{r.get('new_flips_near', '-')} |"
        )
    return "\n".join(out) + "\n"


def main():
    sweep_main(
        __doc__,
        "2 shapes x 64/8192 tokens",
        "store",
        bench,
        markdown,
        full=(SHAPES, TOKENS),
        quick=(QUICK_SHAPES, QUICK_TOKENS),
    )


if __name__ == "__main__":
    main()
